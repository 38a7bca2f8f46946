//! The client-facing HTTP accept loop: hyper connections with a header-read
//! timeout (a client that never finishes its request head is dropped, not
//! held), a bound on open connections (past it, accepting waits), and a
//! graceful drain at shutdown (in-flight responses finish within the drain
//! timeout; idle keep-alive connections close at once).

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Limits of the client-facing HTTP server.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// A request head must arrive within this.
    pub header_read_timeout: Duration,
    /// Connections open at once; past it, accepting waits for one to close.
    pub max_connections: usize,
    /// At shutdown, how long in-flight responses may take to finish.
    pub drain_timeout: Duration,
}

/// Serve `app` on `listener` until `stop` turns true, then drain.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    loop {
        let permit = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (tcp, _) = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off a
                    // moment instead of spinning.
                    tracing::warn!(event = "edge_http_accept_failed", error = %e);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Responses go out in several writes (SSE events, tunnel frames):
        // without TCP_NODELAY, Nagle holds each small write for the
        // client's delayed ACK (~40 ms).
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tcp), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stopped(&mut stop) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    // Every connection task holds a permit: all permits back means every
    // connection has closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(limits.drain_timeout, permits.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!(
            event = "edge_http_drain_timeout",
            open_connections = limits.max_connections - permits.available_permits()
        );
    }
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
