//! A tenant taking the journal store from the others (R-LIM-6, R-TEN-1):
//! one key continuing a long conversation many times at once (every
//! continuation reads every link of it from the store), and one key's
//! burst of durable streams against the store's writer queue. Another
//! tenant's durable reads and streams meanwhile must be served, promptly;
//! one that fails or stalls is a violation.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use iop_bench::deployment::API_KEY;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::tenant::error_code;
use crate::{ATTACKER_KEY, AttackStats};

/// Links of the attacker's conversation.
const CHAIN_LINKS: usize = 200;

/// How soon another tenant's retrieve of its own stored response must be
/// answered while the attacker reads.
const RETRIEVE_WITHIN: Duration = Duration::from_secs(1);

/// A retrieve slower than this is slow (one of the Edge's unloaded
/// answers takes a few ms); more than [`SLOW_RETRIEVES_PER_MILLE`] of them
/// slow is a violation of the row.
const SLOW_RETRIEVE: Duration = Duration::from_millis(100);

/// Of the other tenant's retrieves, how many per thousand may be slow
/// (a shared machine's hiccups).
const SLOW_RETRIEVES_PER_MILLE: u64 = 10;

/// How soon another tenant's durable stream (8 tokens) must end
/// `completed` while the attacker writes.
const STREAM_WITHIN: Duration = Duration::from_secs(5);

fn stopped(stop: &AtomicBool) -> bool {
    stop.load(Ordering::Relaxed)
}

fn client() -> Option<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .ok()
}

/// `POST /v1/responses` as `key`: status and body.
async fn respond(
    client: &reqwest::Client,
    addr: SocketAddr,
    key: &str,
    body: &serde_json::Value,
) -> Result<(u16, serde_json::Value), String> {
    let r = client
        .post(format!("http://{addr}/v1/responses"))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let bytes = r.bytes().await.map_err(|e| e.to_string())?;
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    ))
}

/// The attacker builds a [`CHAIN_LINKS`]-link conversation, then `workers`
/// clients continue it over and over at once (`store: false`: only the
/// reads are the attack). The legitimate tenant meanwhile retrieves a
/// stored response of its own, one retrieve after another from 4 clients:
/// each must be answered 200 within [`RETRIEVE_WITHIN`], and at most
/// [`SLOW_RETRIEVES_PER_MILLE`] of them may take over [`SLOW_RETRIEVE`].
/// The attacker's answers are counted (503 `server_busy` past its readers
/// in flight).
pub(crate) async fn long_chain_reads(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    workers: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client() else {
        return;
    };
    let built = Instant::now();
    let mut last: Option<String> = None;
    for turn in 0..CHAIN_LINKS {
        let mut body = serde_json::json!({"model": "m", "input": format!("turn {turn}")});
        if let Some(previous) = &last {
            body["previous_response_id"] = previous.clone().into();
        }
        match respond(&client, addr, ATTACKER_KEY, &body).await {
            Ok((200, object)) => last = object["id"].as_str().map(str::to_owned),
            other => {
                stats.violate(format!("building the conversation: {other:?}"));
                return;
            }
        }
    }
    let Some(last) = last else { return };
    let mine = match respond(
        &client,
        addr,
        API_KEY,
        &serde_json::json!({"model": "m", "input": "mine"}),
    )
    .await
    {
        Ok((200, object)) => object["id"].as_str().unwrap_or_default().to_owned(),
        other => {
            stats.violate(format!("the legitimate tenant's response: {other:?}"));
            return;
        }
    };
    eprintln!(
        "long_chain_reads: a conversation of {CHAIN_LINKS} links built in {:.1} s",
        built.elapsed().as_secs_f64()
    );
    let (stop, stats) = (stop.clone(), stats.clone());
    tasks.spawn(async move {
        let mut all = JoinSet::new();
        for i in 0..workers {
            let (client, stop, stats, last) =
                (client.clone(), stop.clone(), stats.clone(), last.clone());
            all.spawn(async move {
                let body = serde_json::json!({
                    "model": "m", "input": format!("again {i}"), "store": false,
                    "previous_response_id": last,
                });
                while !stopped(&stop) {
                    match respond(&client, addr, ATTACKER_KEY, &body).await {
                        Ok((200, _)) => stats.count("continued"),
                        Ok((status, object)) => {
                            let code = object["error"]["code"].as_str().unwrap_or_default();
                            stats.count(format!("{status} {code}"));
                            // Refused: back off as told (`Retry-After: 1`).
                            // A client that does not is a request flood,
                            // bounded by the tenant's request rate.
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(_) => {
                            stats.count("transport errors");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            });
        }
        let served = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let slow = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let judged = Arc::new(AtomicBool::new(false));
        for _ in 0..4 {
            let (client, stop, stats, mine) =
                (client.clone(), stop.clone(), stats.clone(), mine.clone());
            let (served, slow, judged) = (served.clone(), slow.clone(), judged.clone());
            all.spawn(async move {
                while !stopped(&stop) {
                    let started = Instant::now();
                    let sent = client
                        .get(format!("http://{addr}/v1/responses/{mine}"))
                        .bearer_auth(API_KEY)
                        .send()
                        .await;
                    let answer = match sent {
                        Ok(r) => {
                            let status = r.status().as_u16();
                            let body = r.bytes().await.unwrap_or_default();
                            (status, error_code(&body))
                        }
                        Err(e) => (0, e.to_string()),
                    };
                    let took = started.elapsed();
                    if answer.0 != 200 || took > RETRIEVE_WITHIN {
                        stats.count("legitimate retrieves failed or slow");
                        stats.violate(format!(
                            "the other tenant's retrieve: {} {} after {} ms",
                            answer.0,
                            answer.1,
                            took.as_millis()
                        ));
                    } else if took > SLOW_RETRIEVE {
                        served.fetch_add(1, Ordering::Relaxed);
                        slow.fetch_add(1, Ordering::Relaxed);
                        stats.count(format!(
                            "legitimate retrieves served in over {} ms",
                            SLOW_RETRIEVE.as_millis()
                        ));
                    } else {
                        served.fetch_add(1, Ordering::Relaxed);
                        stats.count("legitimate retrieves served");
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                // The first of the other tenant's clients to stop judges
                // the share of slow retrieves (the attacker's may still be
                // reading).
                let (served, slow) = (served.load(Ordering::Relaxed), slow.load(Ordering::Relaxed));
                if !judged.swap(true, Ordering::Relaxed)
                    && slow * 1000 > served * SLOW_RETRIEVES_PER_MILLE
                {
                    stats.violate(format!(
                        "{slow} of the other tenant's {served} retrieves took over {} ms",
                        SLOW_RETRIEVE.as_millis()
                    ));
                }
            });
        }
        while all.join_next().await.is_some() {}
    });
}

/// The attacker starts durable streams `workers` at a time, over and over
/// (each an 8-token answer journaled event by event: a burst of appends);
/// the legitimate tenant meanwhile runs durable streams of its own, 4 at a
/// time: each must end `completed` within [`STREAM_WITHIN`] (R-TEN-1: the
/// writer queue keeps places for every principal; R-JRN-6: a refused
/// append is tried again within a bound). The attacker's outcomes are
/// counted.
pub(crate) fn durable_write_burst(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    workers: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client() else {
        return;
    };
    for (key, count) in [(ATTACKER_KEY, workers), (API_KEY, 4)] {
        for _ in 0..count {
            let (client, stop, stats) = (client.clone(), stop.clone(), stats.clone());
            tasks.spawn(async move {
                while !stopped(&stop) {
                    let started = Instant::now();
                    let outcome = durable_stream(&client, addr, key).await;
                    let took = started.elapsed();
                    if key == ATTACKER_KEY {
                        stats.count(format!("attacker {outcome}"));
                        if outcome != "completed" {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    } else if outcome != "completed" || took > STREAM_WITHIN {
                        stats.count("legitimate streams failed or slow");
                        stats.violate(format!(
                            "the other tenant's durable stream: {outcome} after {} ms",
                            took.as_millis()
                        ));
                    } else {
                        stats.count("legitimate streams completed");
                    }
                }
            });
        }
    }
}

/// One durable streamed response as `key`: how it ended (`completed`, the
/// terminal event's status, an HTTP status and code, or a transport
/// error).
async fn durable_stream(client: &reqwest::Client, addr: SocketAddr, key: &str) -> String {
    let sent = client
        .post(format!("http://{addr}/v1/responses"))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(r#"{"model":"m","input":"burst","stream":true,"store":true}"#)
        .send()
        .await;
    let r = match sent {
        Ok(r) => r,
        Err(_) => return "transport error".into(),
    };
    let status = r.status().as_u16();
    let body: bytes::Bytes = match r.bytes().await {
        Ok(body) => body,
        Err(_) => return "stream cut".into(),
    };
    if status != 200 {
        return format!("{status} {}", error_code(&body));
    }
    let text = String::from_utf8_lossy(&body);
    for event in [
        "response.completed",
        "response.failed",
        "response.incomplete",
    ] {
        if text.contains(&format!("event: {event}")) {
            return event.trim_start_matches("response.").to_owned();
        }
    }
    "no terminal event".into()
}
