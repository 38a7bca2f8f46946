//! The client-facing HTTP accept loop (R-LIM-1).
//!
//! Every client connection is bounded in time and in number:
//!
//! 1. `accept` is never gated: a connection is accepted, then admitted or
//!    refused at once. Past `max_connections` (or past its source address's
//!    share, `max_connections_per_source`) the oldest connection with no
//!    request in flight is closed to make room (one that never sent a
//!    request goes first); when every connection is busy the newcomer gets a
//!    fast `503` and is closed. Nothing waits in the listen backlog.
//! 2. A connection must complete its first request head (first byte,
//!    HTTP/1-or-2 detection and headers alike) within
//!    `first_request_timeout`; between requests it may stay idle (no request
//!    in flight, HTTP/1 and HTTP/2 alike) for `idle_timeout`; HTTP/1 heads
//!    after the first are also bounded by hyper's `header_read_timeout`.
//! 3. At `max_age` a connection stops taking requests (HTTP/1: closes after
//!    the current response; HTTP/2: GOAWAY) and at `max_age + age_grace` it
//!    is closed whatever it is doing.
//! 4. An HTTP/2 connection runs at most `h2_max_concurrent_streams` streams.
//! 5. At shutdown, in-flight responses finish within the drain timeout; idle
//!    keep-alive connections close at once.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt as _;

/// Limits of the client-facing HTTP server.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// An HTTP/1 request head after the first must arrive within this.
    pub header_read_timeout: Duration,
    /// From accept to the first request head complete (first byte,
    /// protocol detection, headers).
    pub first_request_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// A connection stops taking requests at this age.
    pub max_age: Duration,
    /// After `max_age`, how long in-flight responses may take before the
    /// connection is closed anyway.
    pub age_grace: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one source address.
    pub max_connections_per_source: usize,
    /// Concurrent streams on one HTTP/2 connection.
    pub h2_max_concurrent_streams: u32,
    /// At shutdown, how long in-flight responses may take to finish.
    pub drain_timeout: Duration,
}

impl HttpLimits {
    /// The limits an Edge configuration sets (`[edge]`; the age grace is the
    /// request budget: no response may legitimately take longer).
    pub fn from_config(config: &crate::config::EdgeConfig) -> Self {
        let e = &config.edge;
        Self {
            header_read_timeout: Duration::from_millis(e.header_read_timeout_ms),
            first_request_timeout: Duration::from_millis(e.first_request_timeout_ms),
            idle_timeout: Duration::from_millis(e.idle_timeout_ms),
            max_age: Duration::from_millis(e.max_connection_age_ms),
            age_grace: Duration::from_millis(config.admission.request_budget_ms),
            max_connections: e.max_connections,
            max_connections_per_source: e.connections_per_source(),
            h2_max_concurrent_streams: e.h2_max_concurrent_streams,
            drain_timeout: Duration::from_millis(e.drain_timeout_ms),
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

/// One connection's activity, shared by its task, its requests and the
/// admission registry.
#[derive(Debug)]
struct ConnTrack {
    id: u64,
    source: IpAddr,
    accepted_at: Instant,
    /// Requests whose response has not finished.
    in_flight: AtomicUsize,
    /// Some request started on this connection.
    served: AtomicBool,
    /// When `in_flight` last fell to zero, in ms since `accepted_at`.
    idle_since_ms: AtomicU64,
    /// Asks the connection's task to close it (room for a newcomer).
    evict: Notify,
    /// A request started or ended: the task's deadline moves.
    activity: Notify,
}

impl ConnTrack {
    fn is_idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
    }

    /// When an idle connection is closed for idleness.
    fn idle_deadline(&self, limits: &HttpLimits) -> Instant {
        let since =
            self.accepted_at + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        if self.served.load(Ordering::Acquire) {
            since + limits.idle_timeout
        } else {
            since + limits.first_request_timeout
        }
    }
}

/// Counts one request in flight on its connection until dropped (with the
/// response body, once it is sent or abandoned).
#[derive(Debug)]
struct InFlight(Arc<ConnTrack>);

impl InFlight {
    fn new(track: Arc<ConnTrack>) -> Self {
        track.served.store(true, Ordering::Release);
        track.in_flight.fetch_add(1, Ordering::AcqRel);
        track.activity.notify_one();
        Self(track)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let track = &self.0;
        let since = Instant::now().saturating_duration_since(track.accepted_at);
        track.idle_since_ms.store(
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX),
            Ordering::Release,
        );
        track.in_flight.fetch_sub(1, Ordering::AcqRel);
        track.activity.notify_one();
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

/// What the registry decided about a new connection.
#[derive(Debug)]
enum Admission {
    Admitted(Arc<ConnTrack>),
    /// Every connection it could displace is busy.
    Refused,
}

/// The open connections, oldest first, and how many each source holds.
#[derive(Debug, Default)]
struct Registry {
    conns: BTreeMap<u64, Arc<ConnTrack>>,
    per_source: HashMap<IpAddr, usize>,
    next_id: u64,
}

impl Registry {
    /// Admit a connection from `source`, closing an idle one to make room
    /// when the cap or the source's share is reached.
    fn admit(&mut self, source: IpAddr, now: Instant, limits: &HttpLimits) -> Admission {
        let held = self.per_source.get(&source).copied().unwrap_or(0);
        let victim = if held >= limits.max_connections_per_source {
            match self.idle_victim(Some(source)) {
                Some(v) => Some(v),
                None => return Admission::Refused,
            }
        } else if self.conns.len() >= limits.max_connections {
            match self.idle_victim(None) {
                Some(v) => Some(v),
                None => return Admission::Refused,
            }
        } else {
            None
        };
        if let Some(track) = victim.and_then(|v| self.remove(v)) {
            track.evict.notify_one();
        }
        let id = self.next_id;
        self.next_id += 1;
        let track = Arc::new(ConnTrack {
            id,
            source,
            accepted_at: now,
            in_flight: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(0),
            evict: Notify::new(),
            activity: Notify::new(),
        });
        self.conns.insert(id, track.clone());
        *self.per_source.entry(source).or_insert(0) += 1;
        Admission::Admitted(track)
    }

    /// The connection to close for a newcomer: the oldest one with no
    /// request in flight that never sent a request, else the oldest idle
    /// keep-alive connection (from `source` only, when given).
    fn idle_victim(&self, source: Option<IpAddr>) -> Option<u64> {
        let candidates = || {
            self.conns
                .values()
                .filter(move |t| source.is_none_or(|s| t.source == s) && t.is_idle())
        };
        candidates()
            .find(|t| !t.served.load(Ordering::Acquire))
            .or_else(|| candidates().next())
            .map(|t| t.id)
    }

    fn remove(&mut self, id: u64) -> Option<Arc<ConnTrack>> {
        let track = self.conns.remove(&id)?;
        if let Some(n) = self.per_source.get_mut(&track.source) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&track.source);
            }
        }
        Some(track)
    }
}

/// Serve `app` on `listener` until `stop` turns true, then drain.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
) {
    let registry = Arc::new(Mutex::new(Registry::default()));
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
        let admission = registry.lock().unwrap_or_else(|e| e.into_inner()).admit(
            peer.ip(),
            Instant::now(),
            &limits,
        );
        let track = match admission {
            Admission::Admitted(track) => track,
            Admission::Refused => {
                refuse(tcp);
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
            track,
            registry.clone(),
            limits,
            stop.clone(),
        ));
    }
    drop(listener);
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
fn refuse(tcp: TcpStream) {
    tracing::debug!(event = "edge_http_connection_refused");
    let _ = tcp.try_write(REFUSAL);
}

/// Why a connection's task closed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    Finished,
    Idle,
    Evicted,
    MaxAge,
}

impl Closed {
    fn as_str(self) -> &'static str {
        match self {
            Closed::Finished => "finished",
            Closed::Idle => "idle",
            Closed::Evicted => "evicted",
            Closed::MaxAge => "max_age",
        }
    }
}

/// Serve one connection under its time limits.
async fn serve_connection(
    tcp: TcpStream,
    app: axum::Router,
    builder: Arc<Builder<TokioExecutor>>,
    track: Arc<ConnTrack>,
    registry: Arc<Mutex<Registry>>,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
) {
    let counted = track.clone();
    let service = TowerToHyperService::new(tower::service_fn(
        move |request: hyper::Request<hyper::body::Incoming>| {
            let in_flight = InFlight::new(counted.clone());
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
    let age_deadline = track.accepted_at + limits.max_age;
    let mut draining = false;
    let closed = loop {
        // The idle deadline while nothing is in flight, the age deadline
        // always; a request starting or ending wakes the task to look again.
        let next = if draining {
            age_deadline + limits.age_grace
        } else if track.is_idle() {
            track.idle_deadline(&limits).min(age_deadline)
        } else {
            age_deadline
        };
        tokio::select! {
            _ = conn.as_mut() => break Closed::Finished,
            _ = track.activity.notified() => {}
            _ = track.evict.notified() => {
                if track.is_idle() {
                    break Closed::Evicted;
                }
                // A request started after it was chosen: let it finish.
                if !draining {
                    conn.as_mut().graceful_shutdown();
                    draining = true;
                }
            }
            _ = stopped(&mut stop), if !draining => {
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
            _ = tokio::time::sleep_until(next) => {
                let now = Instant::now();
                if draining {
                    if now >= age_deadline + limits.age_grace {
                        break Closed::MaxAge;
                    }
                } else if now >= age_deadline {
                    conn.as_mut().graceful_shutdown();
                    draining = true;
                } else if track.is_idle() && now >= track.idle_deadline(&limits) {
                    break Closed::Idle;
                }
            }
        }
    };
    registry
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(track.id);
    if closed != Closed::Finished {
        tracing::debug!(
            event = "edge_http_connection_closed",
            reason = closed.as_str()
        );
    }
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(cap: usize, share: usize) -> HttpLimits {
        HttpLimits {
            header_read_timeout: Duration::from_secs(1),
            first_request_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            max_age: Duration::from_secs(60),
            age_grace: Duration::from_secs(1),
            max_connections: cap,
            max_connections_per_source: share,
            h2_max_concurrent_streams: 8,
            drain_timeout: Duration::from_secs(1),
        }
    }

    fn admitted(a: Admission) -> Arc<ConnTrack> {
        match a {
            Admission::Admitted(t) => t,
            Admission::Refused => panic!("refused"),
        }
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[tokio::test]
    async fn at_the_cap_the_oldest_connection_that_never_sent_a_request_makes_room() {
        // R-LIM-1: beyond the cap a newcomer is never left waiting.
        let (mut r, l, now) = (Registry::default(), limits(3, 3), Instant::now());
        let kept_alive = admitted(r.admit(A, now, &l));
        drop(InFlight::new(kept_alive.clone()));
        let silent = admitted(r.admit(B, now, &l));
        let busy = admitted(r.admit(A, now, &l));
        let _busy = InFlight::new(busy.clone());
        let newcomer = admitted(r.admit(B, now, &l));
        assert_eq!(r.conns.len(), 3);
        assert!(
            !r.conns.contains_key(&silent.id),
            "the silent one went first"
        );
        assert!(r.conns.contains_key(&kept_alive.id));
        let _newcomer_busy = InFlight::new(newcomer.clone());
        // Then the idle keep-alive connection; never a busy one.
        admitted(r.admit(B, now, &l));
        assert!(!r.conns.contains_key(&kept_alive.id));
        assert!(r.conns.contains_key(&busy.id));
        assert!(r.conns.contains_key(&newcomer.id));
    }

    #[tokio::test]
    async fn when_every_connection_is_busy_a_newcomer_is_refused() {
        let (mut r, l, now) = (Registry::default(), limits(2, 2), Instant::now());
        let a = admitted(r.admit(A, now, &l));
        let b = admitted(r.admit(B, now, &l));
        let _busy = (InFlight::new(a), InFlight::new(b));
        assert!(matches!(r.admit(A, now, &l), Admission::Refused));
        assert_eq!(r.conns.len(), 2);
    }

    #[tokio::test]
    async fn one_source_cannot_take_more_than_its_share() {
        let (mut r, l, now) = (Registry::default(), limits(10, 2), Instant::now());
        let a1 = admitted(r.admit(A, now, &l));
        let a2 = admitted(r.admit(A, now, &l));
        let _busy = InFlight::new(a1.clone());
        // Over its share, A displaces its own idle connection, not B's.
        let b = admitted(r.admit(B, now, &l));
        admitted(r.admit(A, now, &l));
        assert!(!r.conns.contains_key(&a2.id));
        assert!(r.conns.contains_key(&b.id));
        assert_eq!(r.per_source[&A], 2);
        // With both of A's busy, A is refused while B still gets in.
        let a3 = r.conns.values().find(|t| t.id > b.id).unwrap().clone();
        let _busy3 = InFlight::new(a3);
        assert!(matches!(r.admit(A, now, &l), Admission::Refused));
        admitted(r.admit(B, now, &l));
    }

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
    async fn the_idle_clock_starts_at_accept_then_at_each_response_end() {
        let (mut r, l) = (Registry::default(), limits(2, 2));
        let t = admitted(r.admit(A, Instant::now(), &l));
        assert_eq!(t.idle_deadline(&l), t.accepted_at + l.first_request_timeout);
        let req = InFlight::new(t.clone());
        assert!(!t.is_idle());
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(req);
        assert!(t.is_idle());
        assert_eq!(t.idle_deadline(&l), Instant::now() + l.idle_timeout);
    }
}
