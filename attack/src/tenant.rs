//! A tenant gone rogue against the durable surfaces (SPEC §6, §7): ids
//! and metadata no Edge would issue (R-LIM-5), and requests to a pool
//! whose failover has nowhere to go (R-FAIL-1). Each answer the attacker
//! should never get is a violation of the row, whatever the legitimate
//! client saw.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::{ATTACKER_KEY, AttackStats};

/// The model of the rig's pool of an offline provider and a failing one.
pub(crate) const FRAGILE_MODEL: &str = "fragile";

/// How soon a request to [`FRAGILE_MODEL`] must be answered: well within
/// the Edge's 30 s queue timeout. Its provider fails at once and nothing
/// else can answer; while the health tracker holds the failing provider
/// out of selection (R-FAIL-3) a new request waits for its next probe
/// (about 8 s in this rig), then gets the provider's failure.
const FRAGILE_ANSWER_WITHIN: Duration = Duration::from_secs(12);

fn stopped(stop: &AtomicBool) -> bool {
    stop.load(Ordering::Relaxed)
}

fn client(timeout: Duration) -> Option<reqwest::Client> {
    reqwest::Client::builder().timeout(timeout).build().ok()
}

/// The `error.code` of an error body, if any.
pub(crate) fn error_code(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// One hostile request: method, path, body.
fn hostile_requests() -> Vec<(reqwest::Method, String, Option<String>)> {
    let long = format!("resp_{}", "a".repeat(4_100));
    let ids = [long.as_str(), "resp_*", "resp_a.b.>", "chatcmpl-*"];
    let mut out = Vec::new();
    for id in ids {
        out.push((reqwest::Method::GET, format!("/v1/responses/{id}"), None));
        out.push((reqwest::Method::DELETE, format!("/v1/responses/{id}"), None));
        out.push((
            reqwest::Method::POST,
            format!("/v1/responses/{id}/cancel"),
            None,
        ));
        out.push((
            reqwest::Method::GET,
            format!("/v1/responses/{id}/input_items"),
            None,
        ));
        out.push((
            reqwest::Method::GET,
            format!("/v1/chat/completions/{id}"),
            None,
        ));
        out.push((
            reqwest::Method::POST,
            "/v1/responses".into(),
            Some(
                serde_json::json!({"model": "m", "input": "x", "previous_response_id": id})
                    .to_string(),
            ),
        ));
    }
    // Past OpenAI's bounds (16 pairs, 512-character values).
    let metadata: serde_json::Map<String, serde_json::Value> = (0..20)
        .map(|i| (format!("k{i}"), "v".repeat(600).into()))
        .collect();
    out.push((
        reqwest::Method::POST,
        "/v1/responses".into(),
        Some(
            serde_json::json!({"model": "m", "input": "x", "store": true, "metadata": metadata})
                .to_string(),
        ),
    ));
    out
}

/// `count` clients with the attacker's key sending ids and metadata of no
/// shape the Edge issues (R-LIM-5): each must be answered 400 or 404, for
/// that request alone; a 5xx or a transport error is a violation.
pub(crate) fn malformed_ids(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    count: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client(Duration::from_secs(10)) else {
        return;
    };
    let requests = Arc::new(hostile_requests());
    for worker in 0..count {
        let (client, stop, stats, requests) = (
            client.clone(),
            stop.clone(),
            stats.clone(),
            requests.clone(),
        );
        tasks.spawn(async move {
            let mut i = worker;
            while !stopped(&stop) {
                let (method, path, body) = &requests[i % requests.len()];
                i += 1;
                let mut r = client
                    .request(method.clone(), format!("http://{addr}{path}"))
                    .bearer_auth(ATTACKER_KEY);
                if let Some(body) = body {
                    r = r
                        .header("content-type", "application/json")
                        .body(body.clone());
                }
                let shown: String = path.chars().take(40).collect();
                match r.send().await {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        let body = r.bytes().await.unwrap_or_default();
                        stats.count(format!("status {status}"));
                        if !matches!(status, 400 | 404) {
                            stats.violate(format!(
                                "{method} {shown}...: {status} {}",
                                error_code(&body)
                            ));
                        }
                    }
                    Err(e) => {
                        stats.count("transport errors");
                        stats.violate(format!("{method} {shown}...: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
}

/// `count` clients asking [`FRAGILE_MODEL`], whose pool is a provider
/// whose node is offline and one that answers 503 (R-FAIL-1): each must
/// get the provider's failure within [`FRAGILE_ANSWER_WITHIN`], not wait
/// the queue timeout (and get `queue_timeout`) for a failover with
/// nowhere to go.
pub(crate) fn failover_nowhere(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    count: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client(FRAGILE_ANSWER_WITHIN) else {
        return;
    };
    for _ in 0..count {
        let (client, stop, stats) = (client.clone(), stop.clone(), stats.clone());
        tasks.spawn(async move {
            while !stopped(&stop) {
                let started = Instant::now();
                let sent = client
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .bearer_auth(ATTACKER_KEY)
                    .header("content-type", "application/json")
                    .body(format!(
                        r#"{{"model":"{FRAGILE_MODEL}","messages":[{{"role":"user","content":"hi"}}]}}"#
                    ))
                    .send()
                    .await;
                match sent {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        let code = error_code(&r.bytes().await.unwrap_or_default());
                        let waited = started.elapsed();
                        let within = if waited < Duration::from_secs(1) {
                            "within 1 s"
                        } else {
                            "after 1 s or more"
                        };
                        stats.count(format!("{status} {code} {within}"));
                        if waited > FRAGILE_ANSWER_WITHIN || code == "queue_timeout" {
                            stats.violate(format!(
                                "{status} {code} after {:.1} s",
                                waited.as_secs_f64()
                            ));
                        }
                    }
                    Err(e) => {
                        stats.count("transport errors");
                        stats.violate(format!(
                            "no answer after {:.1} s: {e}",
                            started.elapsed().as_secs_f64()
                        ));
                    }
                }
            }
        });
    }
}

/// The model of the rig's route whose only provider is offline: every
/// request to it waits in the admission queue.
pub(crate) const OFFLINE_MODEL: &str = "offline";

/// `count` clients with the attacker's key sending background responses
/// to [`OFFLINE_MODEL`] until the admission queue is full and past it:
/// one admission refuses must be answered 429 (with `Retry-After`), never
/// 200 for a response that is already `failed`.
pub(crate) fn background_flood(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    count: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client(Duration::from_secs(10)) else {
        return;
    };
    let body =
        serde_json::json!({"model": OFFLINE_MODEL, "input": "x", "background": true}).to_string();
    for _ in 0..count {
        let (client, stop, stats, body) =
            (client.clone(), stop.clone(), stats.clone(), body.clone());
        tasks.spawn(async move {
            while !stopped(&stop) {
                let sent = client
                    .post(format!("http://{addr}/v1/responses"))
                    .bearer_auth(ATTACKER_KEY)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await;
                let r = match sent {
                    Ok(r) => r,
                    Err(_) => {
                        stats.count("transport errors");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let status = r.status().as_u16();
                let retry_after = r.headers().contains_key("retry-after");
                let body = r.bytes().await.unwrap_or_default();
                let code = error_code(&body);
                stats.count(if code.is_empty() {
                    format!("status {status}")
                } else {
                    format!("status {status} {code}")
                });
                if status == 429 && !retry_after {
                    stats.violate("429 without Retry-After");
                }
                if status != 200 {
                    // Refused: this client backs off as it is told.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                let id = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v["id"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                // An accepted background response is queued or running,
                // not one admission already refused.
                tokio::time::sleep(Duration::from_millis(200)).await;
                if let Ok(r) = client
                    .get(format!("http://{addr}/v1/responses/{id}"))
                    .bearer_auth(ATTACKER_KEY)
                    .send()
                    .await
                {
                    let object: serde_json::Value =
                        serde_json::from_slice(&r.bytes().await.unwrap_or_default())
                            .unwrap_or_default();
                    if object["status"] == "failed" {
                        stats.violate(format!(
                            "answered 200, then failed {}",
                            object["error"]["code"].as_str().unwrap_or("")
                        ));
                    }
                }
            }
        });
    }
}

/// The model of the rig's endless provider: an answer of thousands of
/// tokens at a few hundred a second, so a run is still going when it is
/// cancelled.
pub(crate) const ENDLESS_MODEL: &str = "endless";

/// How soon after its cancel a background response must read `cancelled`
/// and its provider call be gone from the endless provider.
const CANCEL_SETTLES_WITHIN: Duration = Duration::from_secs(5);

/// A background response of [`ENDLESS_MODEL`] made by the attacker; its id.
async fn slow_background(client: &reqwest::Client, addr: SocketAddr) -> Option<String> {
    let r = client
        .post(format!("http://{addr}/v1/responses"))
        .bearer_auth(ATTACKER_KEY)
        .header("content-type", "application/json")
        .body(
            serde_json::json!({"model": ENDLESS_MODEL, "input": "x", "background": true, "store": true})
                .to_string(),
        )
        .send()
        .await
        .ok()?;
    if r.status() != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.ok()?).ok()?;
    v["id"].as_str().map(str::to_owned)
}

/// `count` clients with the attacker's key, each starting background
/// responses on [`ENDLESS_MODEL`] and then cancelling every one with a burst
/// of `POST .../cancel` and `DELETE` at once (R-LIM-4: a cancel is never
/// dropped behind a full channel). Violations: a cancelled response not
/// `cancelled` (or gone) within [`CANCEL_SETTLES_WITHIN`], or, at the end,
/// provider calls still running on the endless provider (`endless_stats`, the
/// mock's counters) after every response was cancelled.
pub(crate) fn cancel_storm(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    endless_stats: SocketAddr,
    count: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client(Duration::from_secs(10)) else {
        return;
    };
    let outstanding = Arc::new(std::sync::atomic::AtomicUsize::new(count));
    for _ in 0..count {
        let (client, stop, stats, outstanding) = (
            client.clone(),
            stop.clone(),
            stats.clone(),
            outstanding.clone(),
        );
        tasks.spawn(async move {
            while !stopped(&stop) {
                let mut ids = Vec::new();
                for _ in 0..4 {
                    match slow_background(&client, addr).await {
                        Some(id) => ids.push(id),
                        None => stats.count("background refused"),
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                // The burst: cancel and delete each, several times at once.
                let mut burst = JoinSet::new();
                for id in &ids {
                    for round in 0..8 {
                        let (client, id) = (client.clone(), id.clone());
                        burst.spawn(async move {
                            let request = if round % 2 == 0 {
                                client.post(format!("http://{addr}/v1/responses/{id}/cancel"))
                            } else {
                                client.delete(format!("http://{addr}/v1/responses/{id}"))
                            };
                            request.bearer_auth(ATTACKER_KEY).send().await.map(|r| r.status().as_u16())
                        });
                    }
                }
                while let Some(done) = burst.join_next().await {
                    match done {
                        Ok(Ok(status)) => stats.count(format!("cancel/delete {status}")),
                        _ => stats.count("transport errors"),
                    }
                }
                let deadline = Instant::now() + CANCEL_SETTLES_WITHIN;
                for id in &ids {
                    loop {
                        let status = match client
                            .get(format!("http://{addr}/v1/responses/{id}"))
                            .bearer_auth(ATTACKER_KEY)
                            .send()
                            .await
                        {
                            Ok(r) if r.status() == 404 => "gone".to_owned(),
                            Ok(r) => serde_json::from_slice::<serde_json::Value>(
                                &r.bytes().await.unwrap_or_default(),
                            )
                            .ok()
                            .and_then(|v| v["status"].as_str().map(str::to_owned))
                            .unwrap_or_default(),
                            Err(_) => String::new(),
                        };
                        if status == "cancelled" || status == "gone" {
                            stats.count("responses cancelled");
                            break;
                        }
                        if Instant::now() > deadline {
                            stats.violate(format!("a cancelled response still reads {status:?}"));
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            // The last client out checks that no provider call is left.
            if outstanding.fetch_sub(1, Ordering::SeqCst) == 1 {
                let deadline = Instant::now() + CANCEL_SETTLES_WITHIN;
                loop {
                    let in_flight = match client
                        .get(format!("http://{endless_stats}/mock/stats"))
                        .send()
                        .await
                    {
                        Ok(r) => serde_json::from_slice::<serde_json::Value>(
                            &r.bytes().await.unwrap_or_default(),
                        )
                        .ok()
                        .and_then(|v| v["in_flight"].as_u64()),
                        Err(_) => None,
                    };
                    match in_flight {
                        Some(0) => break,
                        Some(n) if Instant::now() > deadline => {
                            stats.violate(format!(
                                "{n} provider calls still running after every response was cancelled"
                            ));
                            break;
                        }
                        None if Instant::now() > deadline => {
                            stats.violate("the endless provider's counters could not be read");
                            break;
                        }
                        _ => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
            }
        });
    }
}

/// `count` clients with the attacker's key making stored responses and
/// chat completions, fetching, cancelling and deleting them, collecting
/// every id they were given; when the row stops, the Edge's log
/// (`edge_log`) is read for any of them (R-OBS-1: logs name a response by
/// its tag, never its id). Each id found is a violation.
pub(crate) fn ids_in_logs(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    edge_log: std::path::PathBuf,
    count: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client(Duration::from_secs(10)) else {
        return;
    };
    let ids = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let outstanding = Arc::new(std::sync::atomic::AtomicUsize::new(count));
    for _ in 0..count {
        let (client, stop, stats, ids, outstanding, edge_log) = (
            client.clone(),
            stop.clone(),
            stats.clone(),
            ids.clone(),
            outstanding.clone(),
            edge_log.clone(),
        );
        tasks.spawn(async move {
            while !stopped(&stop) {
                for (path, body) in [
                    ("/v1/responses", serde_json::json!({"model": "m", "input": "x", "store": true})),
                    ("/v1/responses", serde_json::json!({"model": ENDLESS_MODEL, "input": "x", "background": true})),
                    ("/v1/chat/completions", serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "store": true})),
                ] {
                    let Ok(r) = client
                        .post(format!("http://{addr}{path}"))
                        .bearer_auth(ATTACKER_KEY)
                        .header("content-type", "application/json")
                        .body(body.to_string())
                        .send()
                        .await
                    else {
                        stats.count("transport errors");
                        continue;
                    };
                    let v: serde_json::Value =
                        serde_json::from_slice(&r.bytes().await.unwrap_or_default())
                            .unwrap_or_default();
                    let Some(id) = v["id"].as_str().map(str::to_owned) else {
                        continue;
                    };
                    stats.count("ids collected");
                    let base = if path == "/v1/responses" { "/v1/responses" } else { "/v1/chat/completions" };
                    for (method, suffix) in [
                        (reqwest::Method::GET, ""),
                        (reqwest::Method::POST, "/cancel"),
                        (reqwest::Method::DELETE, ""),
                    ] {
                        let _ = client
                            .request(method, format!("http://{addr}{base}/{id}{suffix}"))
                            .bearer_auth(ATTACKER_KEY)
                            .send()
                            .await;
                    }
                    ids.lock().unwrap_or_else(|e| e.into_inner()).push(id);
                }
            }
            if outstanding.fetch_sub(1, Ordering::SeqCst) == 1 {
                let log = std::fs::read_to_string(&edge_log).unwrap_or_default();
                let ids = ids.lock().unwrap_or_else(|e| e.into_inner());
                for id in ids.iter() {
                    if log.contains(id.as_str()) {
                        stats.violate(format!("the Edge's log names {id}"));
                    }
                }
                for _ in log.lines() {
                    stats.count("Edge log lines read");
                }
            }
        });
    }
}
