//! The client-facing HTTP accept loop (R-LIM-1).
//!
//! The rules every client connection lives under are the core's
//! ([`iop_core::edge::limits::Connections`]: the cap and the per-source
//! share, which idle connection is evicted for a newcomer, the
//! first-request, idle and age deadlines). This shell carries them out:
//!
//! 1. `accept` is never gated: a connection is accepted, then admitted or
//!    refused at once; a refused one gets a fast `503` and is closed, and
//!    the task of an evicted one is told. Nothing waits in the listen
//!    backlog.
//! 2. Each connection's task sleeps until the core's next deadline for it
//!    and carries out what the core answers: close, or drain (HTTP/1:
//!    close after the current response; HTTP/2: GOAWAY). A request starting
//!    or ending is told to the core and wakes the task. HTTP/1 heads after
//!    the first are also bounded by hyper's `header_read_timeout`.
//! 3. An HTTP/2 connection runs at most `h2_max_concurrent_streams` streams.
//! 4. At shutdown, in-flight responses finish within the drain timeout; idle
//!    keep-alive connections close at once.
//!
//! Core instants are microseconds since the moment `serve` started.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use futures::task::AtomicWaker;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use iop_core::edge::limits::{
    CloseReason, ConnAdmission, ConnId, ConnLimits, ConnStep, Connections, RefusedBy, SourceAddr,
};
use iop_transport::clock::Timer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower::ServiceExt as _;

/// Limits of the client-facing HTTP server.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// An HTTP/1 request head after the first must arrive within this.
    pub header_read_timeout: Duration,
    /// Concurrent streams on one HTTP/2 connection.
    pub h2_max_concurrent_streams: u32,
    /// At shutdown, how long in-flight responses may take to finish.
    pub drain_timeout: Duration,
    /// The count and time limits of every connection (R-LIM-1).
    pub connections: ConnLimits,
}

impl HttpLimits {
    /// The limits an Edge configuration sets (`[edge]`; the age grace is the
    /// request budget: no response may legitimately take longer).
    pub fn from_config(config: &crate::config::EdgeConfig) -> Self {
        let e = &config.edge;
        Self {
            header_read_timeout: Duration::from_millis(e.header_read_timeout_ms),
            h2_max_concurrent_streams: e.h2_max_concurrent_streams,
            drain_timeout: Duration::from_millis(e.drain_timeout_ms),
            connections: ConnLimits {
                first_request_timeout: Duration::from_millis(e.first_request_timeout_ms),
                idle_timeout: Duration::from_millis(e.idle_timeout_ms),
                max_age: Duration::from_millis(e.max_connection_age_ms),
                age_grace: Duration::from_millis(config.admission.request_budget_ms),
                max_connections: e.max_connections,
                max_connections_per_source: e.connections_per_source(),
            },
        }
    }
}

/// The answer a refused connection gets before it is closed: written
/// without waiting (a full socket buffer just means a bare close).
const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/json\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 158\r\n\r\n\
{\"error\":{\"message\":\"The server has too many open connections. Retry shortly.\",\"type\":\"service_unavailable_error\",\"param\":null,\"code\":\"too_many_connections\"}}";

/// Turns tokio's instants into the core's and back: microseconds since
/// `origin`.
#[derive(Debug, Clone, Copy)]
struct Clock {
    origin: tokio::time::Instant,
}

impl Clock {
    /// Far enough for "never"; a deadline past it is not reached.
    const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

    fn now(&self) -> iop_core::time::Instant {
        self.core(tokio::time::Instant::now())
    }

    fn core(&self, at: tokio::time::Instant) -> iop_core::time::Instant {
        let since = at.saturating_duration_since(self.origin);
        iop_core::time::Instant::from_micros(u64::try_from(since.as_micros()).unwrap_or(u64::MAX))
    }

    fn tokio(&self, at: iop_core::time::Instant) -> tokio::time::Instant {
        let since = Duration::from_micros(at.as_micros()).min(Self::FAR);
        self.origin + since
    }
}

/// Wakes one connection's task: what happened, as bits the task takes
/// each turn, and the task's waker. Raising is a `fetch_or` and a wake;
/// the task's poll is an atomic swap and a waker registration, no lock
/// (its loop turns on every wake-up of the connection, requests included).
#[derive(Debug, Default)]
struct Signals {
    raised: AtomicU8,
    waker: AtomicWaker,
}

impl Signals {
    /// The connection was evicted for a newcomer.
    const EVICT: u8 = 1;
    /// A request started or ended: its deadline moved.
    const ACTIVITY: u8 = 2;
    /// The server is stopping: drain.
    const STOP: u8 = 4;

    fn raise(&self, bit: u8) {
        self.raised.fetch_or(bit, Ordering::Release);
        self.waker.wake();
    }

    /// The bits raised since the last take. The waker is registered before
    /// the take, so a raise after it wakes the task again.
    async fn raised(&self) -> u8 {
        std::future::poll_fn(|cx| {
            self.waker.register(cx.waker());
            match self.raised.swap(0, Ordering::AcqRel) {
                0 => Poll::Pending,
                bits => Poll::Ready(bits),
            }
        })
        .await
    }
}

/// The core's registry and each open connection's wake-ups, under one
/// lock.
#[derive(Debug)]
struct Registry {
    connections: Connections,
    signals: HashMap<ConnId, Arc<Signals>>,
}

/// What every connection task and request shares.
#[derive(Debug)]
struct Shared {
    clock: Clock,
    registry: Mutex<Registry>,
}

impl Shared {
    /// Run `f` under the registry's lock (never held across an await).
    fn with<T>(&self, f: impl FnOnce(&mut Registry) -> T) -> T {
        let mut registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut registry)
    }
}

/// Counts one request in flight on its connection until dropped (with the
/// response body, once it is sent or abandoned).
#[derive(Debug)]
struct InFlight {
    shared: Arc<Shared>,
    id: ConnId,
    signals: Arc<Signals>,
}

impl InFlight {
    fn new(shared: Arc<Shared>, id: ConnId, signals: Arc<Signals>) -> Self {
        shared.with(|r| r.connections.request_started(id));
        signals.raise(Signals::ACTIVITY);
        Self {
            shared,
            id,
            signals,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let now = self.shared.clock.now();
        self.shared
            .with(|r| r.connections.request_ended(self.id, now));
        self.signals.raise(Signals::ACTIVITY);
    }
}

/// A response body that keeps its request counted in flight until it ends
/// (hyper may hold a finished body for a while) or is dropped.
struct CountedBody {
    inner: Body,
    in_flight: Mutex<Option<InFlight>>,
}

impl CountedBody {
    fn ended(&self) {
        if let Ok(mut guard) = self.in_flight.lock() {
            guard.take();
        }
    }
}

impl http_body::Body for CountedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.ended();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let end = self.inner.is_end_stream();
        if end {
            self.ended();
        }
        end
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serve `app` on `listener` until `stop` turns true, then drain; every
/// connection's admission is counted in `metrics`.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    metrics: Arc<crate::metrics::EdgeMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let shared = Arc::new(Shared {
        clock: Clock {
            origin: tokio::time::Instant::now(),
        },
        registry: Mutex::new(Registry {
            connections: Connections::new(limits.connections),
            signals: HashMap::new(),
        }),
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.h2_max_concurrent_streams);
    let builder = Arc::new(builder);
    let mut tasks = JoinSet::new();
    loop {
        let (tcp, peer) = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
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
        let now = shared.clock.now();
        let admitted = shared.with(|r| match r.connections.admit(source_addr(peer.ip()), now) {
            ConnAdmission::Refused(by) => Err(by),
            ConnAdmission::Admitted { id, evict } => {
                if let Some(victim) = evict.and_then(|v| r.signals.get(&v)) {
                    victim.raise(Signals::EVICT);
                }
                let signals = Arc::new(Signals::default());
                r.signals.insert(id, signals.clone());
                Ok((id, signals, evict.is_some()))
            }
        });
        let (id, signals) = match admitted {
            Ok((id, signals, evicted)) => {
                metrics.client_connection(None, evicted);
                (id, signals)
            }
            Err(by) => {
                metrics.client_connection(Some(by), false);
                refuse(tcp, by);
                continue;
            }
        };
        // Responses go out in several writes (SSE events, tunnel frames):
        // without TCP_NODELAY, Nagle holds each small write for the
        // client's delayed ACK (~40 ms).
        let _ = tcp.set_nodelay(true);
        tasks.spawn(serve_connection(
            tcp,
            app.clone(),
            builder.clone(),
            id,
            signals,
            shared.clone(),
        ));
    }
    drop(listener);
    // Every open connection drains (a sender gone is a stop too).
    shared.with(|r| {
        for signals in r.signals.values() {
            signals.raise(Signals::STOP);
        }
    });
    let open = tasks.len();
    let drained = tokio::time::timeout(limits.drain_timeout, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            event = "edge_http_drain_timeout",
            open_connections = tasks.len(),
            at_stop = open
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
}

/// A fast `503` for a connection past the caps, then close.
fn refuse(tcp: TcpStream, by: RefusedBy) {
    tracing::debug!(event = "edge_http_connection_refused", limit = by.as_str());
    let _ = tcp.try_write(REFUSAL);
}

/// Serve one connection under the core's time limits for it.
async fn serve_connection(
    tcp: TcpStream,
    app: axum::Router,
    builder: Arc<Builder<TokioExecutor>>,
    id: ConnId,
    signals: Arc<Signals>,
    shared: Arc<Shared>,
) {
    let (counted, counted_signals) = (shared.clone(), signals.clone());
    let service = TowerToHyperService::new(tower::service_fn(
        move |request: hyper::Request<hyper::body::Incoming>| {
            let in_flight = InFlight::new(counted.clone(), id, counted_signals.clone());
            let app = app.clone();
            async move {
                let response = match app.oneshot(request.map(Body::new)).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(response.map(|inner| {
                    Body::new(CountedBody {
                        inner,
                        in_flight: Mutex::new(Some(in_flight)),
                    })
                }))
            }
        },
    ));
    let conn = builder.serve_connection(TokioIo::new(tcp), service);
    tokio::pin!(conn);
    // The core's deadline for the connection, kept across turns.
    let mut timer = Timer::new();
    // `None`: the connection ended by itself.
    let closed: Option<CloseReason> = 'conn: loop {
        // A request starting or ending wakes the task to ask again.
        let next = shared.with(|r| r.connections.poll_timeout(id));
        timer.set(next.map(|at| shared.clock.tokio(at)));
        let steps = tokio::select! {
            _ = conn.as_mut() => break None,
            raised = signals.raised() => [
                (raised & Signals::EVICT != 0)
                    .then(|| shared.with(|r| r.connections.handle_eviction(id))),
                (raised & Signals::STOP != 0)
                    .then(|| shared.with(|r| r.connections.handle_stop(id))),
            ],
            () = timer.fired() => {
                let now = shared.clock.now();
                [Some(shared.with(|r| r.connections.handle_timeout(id, now))), None]
            }
        };
        for step in steps.into_iter().flatten() {
            match step {
                ConnStep::Wait => {}
                ConnStep::Drain => conn.as_mut().graceful_shutdown(),
                ConnStep::Close(reason) => break 'conn Some(reason),
            }
        }
    };
    shared.with(|r| {
        r.connections.closed(id);
        r.signals.remove(&id);
    });
    if let Some(reason) = closed {
        tracing::debug!(
            event = "edge_http_connection_closed",
            reason = reason.as_str()
        );
    }
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The socket's address as R-LIM-1 counts it (IPv4 in its IPv6-mapped
/// form, so one host is one source whichever family it came in on).
fn source_addr(ip: std::net::IpAddr) -> SourceAddr {
    SourceAddr(match ip.to_canonical() {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_a_complete_503_with_its_length() {
        let text = std::str::from_utf8(REFUSAL).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }

    #[tokio::test(start_paused = true)]
    async fn the_clock_turns_tokio_instants_into_core_microseconds_and_back() {
        let clock = Clock {
            origin: tokio::time::Instant::now(),
        };
        assert_eq!(clock.now(), iop_core::time::Instant::ZERO);
        tokio::time::advance(Duration::from_millis(1_500)).await;
        let now = clock.now();
        assert_eq!(now, iop_core::time::Instant::from_millis(1_500));
        assert_eq!(clock.tokio(now), tokio::time::Instant::now());
        // A deadline at "never" is far away, not an overflow.
        assert!(clock.tokio(iop_core::time::Instant::MAX) > tokio::time::Instant::now());
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_is_counted_in_the_core_from_its_start_to_its_end() {
        // R-LIM-1: the idle clock restarts when the response ends.
        let limits = ConnLimits {
            first_request_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(3),
            max_age: Duration::from_secs(60),
            age_grace: Duration::from_secs(1),
            max_connections: 2,
            max_connections_per_source: 2,
        };
        let shared = Arc::new(Shared {
            clock: Clock {
                origin: tokio::time::Instant::now(),
            },
            registry: Mutex::new(Registry {
                connections: Connections::new(limits),
                signals: HashMap::new(),
            }),
        });
        let source = source_addr(std::net::IpAddr::from([127, 0, 0, 1]));
        let now = shared.clock.now();
        let ConnAdmission::Admitted { id, .. } = shared.with(|r| r.connections.admit(source, now))
        else {
            panic!("refused");
        };
        let signals = Arc::new(Signals::default());
        let deadline = || shared.with(|r| r.connections.poll_timeout(id));
        assert_eq!(deadline(), Some(now + limits.first_request_timeout));
        let request = InFlight::new(shared.clone(), id, signals.clone());
        assert_eq!(deadline(), Some(now + limits.max_age), "busy");
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(request);
        assert_eq!(deadline(), Some(shared.clock.now() + limits.idle_timeout));
        // Each change woke the connection's task.
        assert_eq!(signals.raised().await, Signals::ACTIVITY);
    }

    #[tokio::test]
    async fn a_raised_signal_wakes_the_connection_task_with_every_bit_once() {
        let signals = Arc::new(Signals::default());
        signals.raise(Signals::EVICT);
        signals.raise(Signals::STOP);
        assert_eq!(signals.raised().await, Signals::EVICT | Signals::STOP);
        // Taken: nothing until raised again, and a raise wakes the task
        // waiting for it.
        let waiting = tokio::spawn({
            let signals = signals.clone();
            async move { signals.raised().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        signals.raise(Signals::ACTIVITY);
        assert_eq!(waiting.await.unwrap(), Signals::ACTIVITY);
    }
}
