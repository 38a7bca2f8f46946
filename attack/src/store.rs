//! The journal store taken away (R-JRN-6): an Edge started while its
//! store is down, and a store that goes away under durable streams.
//! Neither is a client's doing, but each was a way to take the whole
//! Edge (or every durable stream in flight) down, so each is a row: the
//! Edge must serve what needs no store, refuse durable requests with a
//! clear 503 while the store is away, and serve them again by itself.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use iop_bench::deployment::{Proc, nats_server_args, nats_server_binary};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::tenant::error_code;
use crate::{ATTACKER_KEY, AttackStats};

/// The route of durable streams long enough to be in flight when the
/// store goes away: 40 tokens at 20 a second.
pub(crate) const SLOW_MODEL: &str = "slow";

/// The node target of [`SLOW_MODEL`]'s provider: a mock that streams 40
/// tokens at 20 a second.
pub(crate) const SLOW_TARGET: &str = "slow";

/// How long the store stays away in `store_down_at_start`.
const DOWN_FOR: Duration = Duration::from_secs(4);

/// Durable requests must be served again within this after the store is
/// back: the Edge's next open attempt (backoff at most 5 s), and on NATS
/// its own lease's watch (two renewal intervals of the rig's 3 s TTL).
const BACK_WITHIN: Duration = Duration::from_secs(15);

/// How long the store is away under the streams of
/// `store_outage_midstream`: past the store's answer timeout (5 s: a
/// write caught by the outage fails, whatever the client buffered), and
/// within the Edge's write retry (10 s).
const BLIP_FOR: Duration = Duration::from_secs(6);

/// An accepted stream of [`SLOW_MODEL`] (2 s) must end within this: its
/// own time, the outage, the store client's reconnect (at most 1 s) and
/// a retry's delay (at most 1 s).
const STREAM_WITHIN: Duration = Duration::from_secs(14);

/// How the rig takes its journal store away and gives it back.
pub(crate) enum StoreControl {
    /// The embedded file: moved aside and replaced by garbage (an
    /// unopenable file), then put back.
    Embedded {
        /// The journal file.
        file: PathBuf,
    },
    /// NATS: the server killed, then started again on the same port and
    /// store directory.
    Nats {
        /// Its client address.
        addr: SocketAddr,
        /// The rig's directory (logs, the server's store).
        dir: PathBuf,
        /// The running server.
        proc: Box<tokio::sync::Mutex<Option<Proc>>>,
    },
}

impl StoreControl {
    /// `store` or `nats`.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            StoreControl::Embedded { .. } => "embedded",
            StoreControl::Nats { .. } => "nats",
        }
    }

    /// The NATS server's URL, for a NATS journal.
    pub(crate) fn nats_url(&self) -> Option<String> {
        match self {
            StoreControl::Nats { addr, .. } => Some(format!("nats://{addr}")),
            StoreControl::Embedded { .. } => None,
        }
    }

    /// Take the store away.
    pub(crate) async fn down(&self) -> anyhow::Result<()> {
        match self {
            StoreControl::Embedded { file } => {
                let kept = kept(file);
                if file.exists() {
                    std::fs::rename(file, &kept).context("moving the journal aside")?;
                }
                std::fs::write(file, vec![0xa5_u8; 64 * 1024]).context("an unopenable file")?;
            }
            StoreControl::Nats { proc, .. } => {
                if let Some(p) = proc.lock().await.take() {
                    p.stop().await;
                }
            }
        }
        Ok(())
    }

    /// Give it back.
    pub(crate) async fn up(&self) -> anyhow::Result<()> {
        match self {
            StoreControl::Embedded { file } => {
                let kept = kept(file);
                if kept.exists() {
                    std::fs::rename(&kept, file).context("putting the journal back")?;
                }
            }
            StoreControl::Nats { addr, dir, proc } => {
                let mut running = proc.lock().await;
                if running.is_none() {
                    *running = Some(start_nats(*addr, dir).await?);
                }
            }
        }
        Ok(())
    }
}

fn kept(file: &Path) -> PathBuf {
    file.with_extension("redb.kept")
}

/// `nats-server` with JetStream on `addr`, its store in `<dir>/nats-js`
/// (the one the rig's first server used), once it accepts connections.
pub(crate) async fn start_nats(addr: SocketAddr, dir: &Path) -> anyhow::Result<Proc> {
    let binary = nats_server_binary().context("nats-server is not installed")?;
    let args = nats_server_args(addr, dir)?;
    let mut proc = Proc::spawn("nats-server-again", &binary, &args, dir, false)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        proc.check_alive()?;
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(proc);
        }
        if Instant::now() > deadline {
            bail!("nats-server did not accept connections again");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn client() -> Option<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .ok()
}

/// `store_down_at_start`, once the Edge was started while its store was
/// away and serves: a client with the attacker's key sends a durable
/// request every 250 ms. While the store is away each must be refused 503
/// `response_store_unavailable`; after [`DOWN_FOR`] the store is given
/// back, and a durable request must succeed within [`BACK_WITHIN`]
/// (without a restart: the same Edge process).
pub(crate) fn durable_while_store_away(
    tasks: &mut JoinSet<()>,
    http: SocketAddr,
    store: Arc<StoreControl>,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client() else {
        return;
    };
    let (stop, stats) = (stop.clone(), stats.clone());
    tasks.spawn(async move {
        let started = Instant::now();
        let mut back_at: Option<Instant> = None;
        let mut served = false;
        loop {
            if stop.load(Ordering::Relaxed) {
                // The row ends: the store must have been served again by
                // now (the row lasts well past DOWN_FOR + BACK_WITHIN's
                // first seconds; a longer one sees BACK_WITHIN below).
                if !served {
                    stats.violate(format!(
                        "durable requests still refused at the end of the row, {:.1} s after the store came back",
                        back_at.map_or(0.0, |at| at.elapsed().as_secs_f64())
                    ));
                }
                return;
            }
            if back_at.is_none() && started.elapsed() >= DOWN_FOR {
                if let Err(e) = store.up().await {
                    stats.violate(format!("the rig could not give the store back: {e:#}"));
                    return;
                }
                back_at = Some(Instant::now());
            }
            if let Some(at) = back_at
                && !served
                && at.elapsed() > BACK_WITHIN
            {
                stats.violate(format!(
                    "durable requests still refused {} s after the store came back",
                    BACK_WITHIN.as_secs()
                ));
                return;
            }
            let sent = client
                .post(format!("http://{http}/v1/responses"))
                .bearer_auth(ATTACKER_KEY)
                .header("content-type", "application/json")
                .body(r#"{"model":"m","input":"keep me","store":true}"#)
                .send()
                .await;
            match sent {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let code = error_code(&r.bytes().await.unwrap_or_default());
                    match (status, back_at) {
                        (200, Some(at)) => {
                            if !served {
                                served = true;
                                stats.count(format!(
                                    "durable served {:.1} s after the store came back",
                                    at.elapsed().as_secs_f64()
                                ));
                            }
                            stats.count("durable 200 after");
                        }
                        (503, _) if code == "response_store_unavailable" => {
                            stats.count(if back_at.is_none() {
                                "durable 503 response_store_unavailable while away"
                            } else {
                                "durable 503 response_store_unavailable while it opened again"
                            });
                        }
                        (status, _) => stats.violate(format!(
                            "a durable request answered {status} {code} {}",
                            if back_at.is_none() {
                                "while the store was away"
                            } else {
                                "after the store came back"
                            }
                        )),
                    }
                }
                Err(e) => stats.violate(format!("a durable request got no answer: {e}")),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
}

/// `store_outage_midstream`: `count` clients with the attacker's key
/// stream durable responses of [`SLOW_MODEL`] (2 s each) back to back;
/// 3 s in, the store goes away for [`BLIP_FOR`], then comes back. A
/// stream the Edge accepted must end `response.completed` within
/// [`STREAM_WITHIN`]: the Edge tries its writes again within its bound
/// (10 s) instead of failing the response. A new request refused 503
/// while the store is away is fine.
pub(crate) fn streams_through_an_outage(
    tasks: &mut JoinSet<()>,
    http: SocketAddr,
    count: usize,
    store: Arc<StoreControl>,
    stop: &Arc<AtomicBool>,
    stats: &Arc<AttackStats>,
) {
    let Some(client) = client() else {
        return;
    };
    {
        let (stats, stop) = (stats.clone(), stop.clone());
        tasks.spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if let Err(e) = store.down().await {
                stats.violate(format!("the rig could not take the store away: {e:#}"));
                return;
            }
            stats.count(format!("store away for {} s", BLIP_FOR.as_secs()));
            tokio::time::sleep(BLIP_FOR).await;
            if let Err(e) = store.up().await {
                stats.violate(format!("the rig could not give the store back: {e:#}"));
            }
        });
    }
    let body = serde_json::json!({
        "model": SLOW_MODEL, "input": "x", "stream": true, "store": true
    })
    .to_string();
    for _ in 0..count {
        let (client, stop, stats, body) =
            (client.clone(), stop.clone(), stats.clone(), body.clone());
        tasks.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let sent = client
                    .post(format!("http://{http}/v1/responses"))
                    .bearer_auth(ATTACKER_KEY)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await;
                let r = match sent {
                    Ok(r) => r,
                    Err(e) => {
                        stats.violate(format!("a durable stream got no answer: {e}"));
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                let status = r.status().as_u16();
                if status != 200 {
                    let code = error_code(&r.bytes().await.unwrap_or_default());
                    if status == 503 && code == "response_store_unavailable" {
                        stats.count("new stream refused 503 while the store was away");
                    } else {
                        stats.violate(format!("a new stream answered {status} {code}"));
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                let text = match tokio::time::timeout(STREAM_WITHIN, r.text()).await {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        stats.violate(format!("an accepted stream broke off: {e}"));
                        continue;
                    }
                    Err(_) => {
                        stats.violate(format!(
                            "an accepted stream did not end within {} s",
                            STREAM_WITHIN.as_secs()
                        ));
                        continue;
                    }
                };
                let last = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("event: "))
                    .next_back()
                    .unwrap_or("")
                    .to_owned();
                if last == "response.completed" {
                    stats.count("streams completed");
                } else {
                    let code = text
                        .lines()
                        .filter_map(|l| l.strip_prefix("data: "))
                        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
                        .filter_map(|v| {
                            v["response"]["error"]["code"]
                                .as_str()
                                .or(v["error"]["code"].as_str())
                                .map(str::to_owned)
                        })
                        .next_back()
                        .unwrap_or_default();
                    stats.violate(format!("an accepted stream ended {last} {code}"));
                }
            }
        });
    }
}
