//! The reconnect supervisor: for every configured Edge (R-MULTI-1), dial
//! it, run the link until it ends, back off (capped, jittered, from the
//! core's schedule) and dial again. Each Edge has its own loop, backoff
//! and connection (its own generation, heartbeat and readiness); they
//! share one QUIC endpoint and the node's state.

use std::net::SocketAddr;
use std::sync::Arc;

use iop_core::liveness::backoff::{AttemptEnd, Reconnect};
use iop_core::rng::SplitMix64;
use iop_transport::{ClientTls, client_endpoint, connect};
use tokio::sync::watch;

use crate::config::NodeConfig;
use crate::error::StartError;
use crate::link::{self, LinkEnd};
use crate::state::LinkShared;

/// Resolve `host:port`.
async fn resolve(edge: &str) -> Option<SocketAddr> {
    tokio::net::lookup_host(edge).await.ok()?.next()
}

/// Dial, serve, back off, for every Edge, until `shutdown` turns true.
pub async fn run(
    config: Arc<NodeConfig>,
    shared: Arc<LinkShared>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), StartError> {
    let tls = ClientTls::from_files(&config.tls.cert, &config.tls.key, &config.tls.ca)?;
    let tuning = config.quic_tuning;
    let endpoint = client_endpoint(&tls, &tuning)?;
    let loops = (0..config.edges.len()).map(|edge| {
        edge_loop(
            config.clone(),
            shared.clone(),
            endpoint.clone(),
            edge,
            shutdown.clone(),
        )
    });
    futures::future::join_all(loops).await;
    endpoint.close(
        iop_wire::CloseCode::Shutdown.code().into(),
        iop_wire::CloseCode::Shutdown.as_str().as_bytes(),
    );
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), endpoint.wait_idle()).await;
    Ok(())
}

/// One Edge's loop: dial, serve, back off, until `shutdown` turns true.
async fn edge_loop(
    config: Arc<NodeConfig>,
    shared: Arc<LinkShared>,
    endpoint: quinn::Endpoint,
    edge: usize,
    mut shutdown: watch::Receiver<bool>,
) {
    let address = &config.edges[edge];
    let mut reconnect = Reconnect::new(config.reconnect);
    let mut rng = SplitMix64::new(rand::random());
    loop {
        if *shutdown.borrow() {
            break;
        }
        // One `node.dial` span per attempt (its own trace): how long dialing
        // took and, on failure, a closed error class.
        let dial_span =
            shared
                .metrics
                .tracer()
                .start("node.dial", iop_transport::traces::Kind::Client, None);
        let attempt = async {
            let addr = resolve(address)
                .await
                .ok_or("cannot resolve the edge address")?;
            // A dead edge never answers a QUIC handshake: bound the attempt
            // so the backoff schedule, not the idle timeout, paces retries.
            let dial = connect(&endpoint, addr, &config.node.edge_server_name);
            match tokio::time::timeout(config.connect_timeout, dial).await {
                Ok(Ok(conn)) => Ok(conn),
                Ok(Err(e)) => {
                    tracing::warn!(event = "node_connect_failed", edge = %address, error = %e);
                    Err("connect failed")
                }
                Err(_) => Err("connect timed out"),
            }
        };
        let mut lasted = std::time::Duration::ZERO;
        let end = tokio::select! {
            conn = attempt => match conn {
                Ok(conn) => {
                    dial_span.ok();
                    drop(dial_span);
                    let started = tokio::time::Instant::now();
                    let end = link::run(conn, config.clone(), shared.clone(), edge, shutdown.clone()).await;
                    lasted = started.elapsed();
                    Some(end)
                }
                Err(why) => {
                    dial_span.fail(match why {
                        "cannot resolve the edge address" => "unresolved",
                        "connect timed out" => "connect_timeout",
                        _ => "connect_failed",
                    });
                    tracing::warn!(event = "node_dial_failed", edge = %address, reason = why);
                    None
                }
            },
            _ = shutdown.changed() => break,
        };
        // The schedule is the core's (R-HB-2); here: counters and logs.
        let attempt_end = match &end {
            Some(LinkEnd::Shutdown) => break,
            None => AttemptEnd::NoConnection,
            Some(LinkEnd::Closed {
                code: iop_wire::CloseCode::Superseded,
                ..
            }) => AttemptEnd::Superseded,
            Some(LinkEnd::Closed { was_ready, .. }) => AttemptEnd::Closed {
                was_ready: *was_ready,
            },
            Some(LinkEnd::Rejected { .. } | LinkEnd::Failed(_) | LinkEnd::HandshakeTimeout) => {
                AttemptEnd::Failed
            }
        };
        if attempt_end.failed() {
            shared
                .failed_attempts
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let delay = reconnect.after(attempt_end, lasted, &mut rng);
        match end {
            Some(LinkEnd::Closed {
                code: iop_wire::CloseCode::Superseded,
                ..
            }) => {
                // Another process with this node's certificate connected:
                // wait long before taking the node back.
                shared
                    .superseded
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                shared.edges[edge].last_close_code.store(
                    u64::from(iop_wire::CloseCode::Superseded.code()),
                    std::sync::atomic::Ordering::Relaxed,
                );
                tracing::error!(
                    event = "node_superseded",
                    edge = %address,
                    in_a_row = reconnect.superseded_in_a_row(),
                    delay_ms = delay.as_millis() as u64,
                    detail = "another process connected with this node's certificate"
                );
            }
            Some(LinkEnd::Closed { code, .. }) => {
                shared.edges[edge]
                    .last_close_code
                    .store(u64::from(code.code()), std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(event = "node_link_closed", edge = %address, reason = code.as_str());
            }
            Some(LinkEnd::Rejected { reason, message }) => {
                tracing::error!(
                    event = "node_registration_rejected",
                    edge = %address,
                    reason = reason.as_str(),
                    detail = %message
                );
            }
            Some(LinkEnd::Failed(e)) => {
                tracing::warn!(event = "node_link_failed", edge = %address, error = %e);
            }
            Some(LinkEnd::HandshakeTimeout) => {
                tracing::warn!(event = "node_handshake_timeout", edge = %address);
            }
            Some(LinkEnd::Shutdown) | None => {}
        }
        tracing::info!(
            event = "node_reconnect_backoff",
            edge = %address,
            delay_ms = delay.as_millis() as u64,
            attempt = reconnect.attempt()
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => break,
        }
    }
}
