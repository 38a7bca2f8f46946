//! The Node's HTTP client for provider calls: hyper's pooled HTTP/1.1
//! client, over TLS for `https` targets, whose TCP sockets acknowledge what
//! they read at once.
//!
//! Why its own connector: many provider servers (llama.cpp's, anything on
//! axum or cpp-httplib) leave Nagle's algorithm on and write a streamed
//! answer one small event at a time. Nagle holds each next small write
//! until the previous one is acknowledged, and Linux delays the ACK of a
//! socket that only reads (a keep-alive connection that just sent a request
//! is in "interactive" mode) by up to 40 ms. So every answer the Node
//! streams from such a server would pause ~40 ms after its first event,
//! although a client calling the server directly for the same answer whole
//! gets it in one write. [`QuickAckStream`] sets `TCP_QUICKACK` after
//! every read that returned data: the kernel sends the pending ACK right
//! then, and the server's next write goes out without waiting.
//!
//! A target can have its plain-`http` calls driven by the caller
//! ([`ProviderHttp::caller_driven`], every adapter's): the HTTP/1.1
//! connection is then polled by the task that awaits the answer and reads
//! its body (the run's), not by a connection task of its own, and goes
//! back to an idle list of the process once its answer was read whole. A
//! connection found closed when taken is dropped; a request that a reused
//! connection never sent goes out on a new one.
//!
//! A streamed answer's content ends before its body does: after an SSE
//! stream's `[DONE]` (or `message_stop`, or Ollama's `done` line) the
//! chunked encoding's last chunk is still to come, often in a later
//! segment. A body dropped before its end takes its connection with it,
//! so an adapter that has read the whole content calls
//! [`ProviderBytes::finish`]: the rest is read in the background, bounded
//! ([`FINISH_TIMEOUT`], [`FINISH_MAX_BYTES`], [`MAX_FINISHING`]), and the
//! connection goes back for the next call instead of every streamed call
//! paying a new connection (and, to an `https` provider, a TLS handshake).
//! A body dropped without `finish` (a canceled run) still closes its
//! connection at once, which is how a provider learns to stop generating.
//!
//! Not supported, on purpose: `HTTP_PROXY`/`HTTPS_PROXY` (a provider is
//! reached directly), redirects (a tunnel passes them through as they are),
//! response decompression (tunnelled bodies stay as the provider sent them).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use http::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::client::conn::http1;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How long connecting to a provider may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an idle pooled provider connection is kept.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Idle caller-driven connections kept per target address.
pub const MAX_IDLE_PER_TARGET: usize = 64;

/// How long the rest of a finished answer's body is read for
/// ([`ProviderBytes::finish`]); its connection closes if it has not ended.
pub const FINISH_TIMEOUT: Duration = Duration::from_secs(1);

/// How much of the rest of a finished answer's body is read; more, and its
/// connection closes.
pub const FINISH_MAX_BYTES: usize = 64 * 1024;

/// How many finished answers' rests a process reads at once; beyond, their
/// connections close.
pub const MAX_FINISHING: usize = 256;

/// Why a provider call failed before or while its answer was read. The
/// error's text is never kept: it may name URLs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// The request could not be built (URL, header).
    #[error("request could not be built")]
    Builder,
    /// Connecting took longer than [`CONNECT_TIMEOUT`].
    #[error("connect timed out")]
    Timeout,
    /// No answer: connecting, the TLS handshake or sending failed, or the
    /// connection broke before the answer's head.
    #[error("provider unreachable")]
    Unreachable,
    /// The connection broke while the answer's body was read.
    #[error("answer body broke")]
    Body,
}

/// The shared client of every provider call of a process: cheap to clone.
#[derive(Clone)]
pub struct ProviderHttp {
    client: Client<HttpsConnector<QuickAckConnector>, Full<Bytes>>,
    /// The process's idle caller-driven connections.
    idle: Arc<IdleConnections>,
    /// Plain-`http` calls are driven by the caller.
    caller_driven: bool,
    /// Finished answers whose rest is being read ([`MAX_FINISHING`]).
    finishing: Arc<AtomicUsize>,
}

impl std::fmt::Debug for ProviderHttp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderHttp").finish_non_exhaustive()
    }
}

impl ProviderHttp {
    /// A client that verifies `https` providers with the platform's
    /// certificate roots, with the process's rustls crypto provider (ring
    /// if none is installed). If the platform verifier cannot be set up,
    /// `https` calls fail their handshake and plain `http` still works.
    pub fn new() -> Self {
        let provider = rustls::crypto::CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
        let tls = tls_config(provider);
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let plain = QuickAckConnector(http);
        let connector = HttpsConnector::from((plain.clone(), tls));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(connector);
        Self {
            client,
            idle: Arc::new(IdleConnections {
                connector: plain,
                idle: Mutex::new(HashMap::new()),
            }),
            caller_driven: false,
            finishing: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The same client, with its plain-`http` calls driven by the caller:
    /// the connection is polled by the task that awaits the answer and
    /// reads its body, with no connection task between them (see the
    /// module docs). `https` calls stay on the pooled client.
    pub fn caller_driven(&self) -> Self {
        Self {
            caller_driven: true,
            ..self.clone()
        }
    }

    /// A request to `url`.
    pub fn request(&self, method: Method, url: String) -> ProviderRequest {
        ProviderRequest {
            client: self.clone(),
            method,
            url,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            invalid: false,
        }
    }

    /// Finished answers whose rest is being read now
    /// ([`ProviderBytes::finish`]).
    #[cfg(test)]
    pub(crate) fn finishing(&self) -> usize {
        self.finishing.load(Ordering::SeqCst)
    }

    /// A `GET` of `url`.
    pub fn get(&self, url: String) -> ProviderRequest {
        self.request(Method::GET, url)
    }

    /// A `POST` to `url`.
    pub fn post(&self, url: String) -> ProviderRequest {
        self.request(Method::POST, url)
    }
}

impl Default for ProviderHttp {
    fn default() -> Self {
        Self::new()
    }
}

fn tls_config(provider: Arc<rustls::crypto::CryptoProvider>) -> rustls::ClientConfig {
    // A process provider without TLS 1.2/1.3 suites: ring's, which has them.
    let (provider, builder) = match rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
    {
        Ok(builder) => (provider, builder),
        Err(e) => {
            tracing::warn!(event = "provider_tls_crypto_fallback", error = %e);
            let ring = Arc::new(rustls::crypto::ring::default_provider());
            let builder = rustls::ClientConfig::builder_with_provider(ring.clone())
                .with_safe_default_protocol_versions()
                .expect("ring supports the default TLS versions");
            (ring, builder)
        }
    };
    let mut config = match rustls_platform_verifier::Verifier::new(provider) {
        Ok(verifier) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth(),
        Err(e) => {
            tracing::warn!(event = "provider_tls_roots_unavailable", error = %e);
            builder
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        }
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config
}

/// One provider request being built.
pub struct ProviderRequest {
    client: ProviderHttp,
    method: Method,
    url: String,
    headers: HeaderMap,
    body: Bytes,
    /// A header could not be built: sending fails with
    /// [`HttpError::Builder`].
    invalid: bool,
}

impl ProviderRequest {
    /// Add a header.
    pub fn header(mut self, name: HeaderName, value: &str) -> Self {
        match HeaderValue::from_str(value) {
            Ok(value) => {
                self.headers.append(name, value);
            }
            Err(_) => self.invalid = true,
        }
        self
    }

    /// Add headers.
    pub fn headers(mut self, headers: HeaderMap) -> Self {
        for (name, value) in headers {
            if let Some(name) = name {
                self.headers.append(name, value);
            }
        }
        self
    }

    /// Add a header unless the request has one of that name already.
    pub fn header_if_absent(self, name: HeaderName, value: &str) -> Self {
        if self.headers.contains_key(&name) {
            return self;
        }
        self.header(name, value)
    }

    /// Set a header that carries a secret (a key), marked sensitive.
    pub fn sensitive_header(mut self, name: HeaderName, secret: &str) -> Self {
        match HeaderValue::from_str(secret) {
            Ok(mut value) => {
                value.set_sensitive(true);
                self.headers.insert(name, value);
            }
            Err(_) => self.invalid = true,
        }
        self
    }

    /// `Authorization: Bearer <key>`, marked sensitive.
    pub fn bearer_auth(mut self, key: &str) -> Self {
        match HeaderValue::from_str(&format!("Bearer {key}")) {
            Ok(mut value) => {
                value.set_sensitive(true);
                self.headers.insert(AUTHORIZATION, value);
            }
            Err(_) => self.invalid = true,
        }
        self
    }

    /// The request body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// Send it: the answer's head, whatever its status.
    pub async fn send(self) -> Result<ProviderResponse, HttpError> {
        if self.invalid {
            return Err(HttpError::Builder);
        }
        let uri: Uri = self.url.parse().map_err(|_| HttpError::Builder)?;
        let mut request = Request::builder()
            .method(self.method)
            .uri(uri)
            .body(Full::new(self.body))
            .map_err(|_| HttpError::Builder)?;
        *request.headers_mut() = self.headers;
        let finishing = Arc::clone(&self.client.finishing);
        if self.client.caller_driven && request.uri().scheme() == Some(&http::uri::Scheme::HTTP) {
            let (status, headers, body) = self.client.idle.send(request).await?;
            return Ok(ProviderResponse {
                status,
                headers,
                body,
                finishing,
            });
        }
        let response = self
            .client
            .client
            .request(request)
            .await
            .map_err(|e| classify(&e))?;
        let (parts, body) = response.into_parts();
        Ok(ProviderResponse {
            status: parts.status,
            headers: parts.headers,
            body: UnsyncBoxBody::new(body),
            finishing,
        })
    }
}

/// A failed send: a connect that timed out, or unreachable.
fn classify(err: &(dyn std::error::Error + 'static)) -> HttpError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<io::Error>()
            && io.kind() == io::ErrorKind::TimedOut
        {
            return HttpError::Timeout;
        }
        source = e.source();
    }
    HttpError::Unreachable
}

/// A provider's answer: its head, and its body to read.
pub struct ProviderResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: UnsyncBoxBody<Bytes, hyper::Error>,
    /// The client's count of finishing answers.
    finishing: Arc<AtomicUsize>,
}

impl ProviderResponse {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The next piece of the body; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, HttpError> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(_)) => return Err(HttpError::Body),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// The body as a stream of pieces.
    pub fn bytes_stream(self) -> ProviderBytes {
        ProviderBytes {
            body: self.body,
            finishing: self.finishing,
        }
    }
}

/// An answer's body as a stream of its pieces.
pub struct ProviderBytes {
    body: UnsyncBoxBody<Bytes, hyper::Error>,
    finishing: Arc<AtomicUsize>,
}

impl Stream for ProviderBytes {
    type Item = Result<Bytes, HttpError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            return match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Err(_))) => Poll::Ready(Some(Err(HttpError::Body))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => Poll::Ready(Some(Ok(data))),
                    // Trailers, or an empty piece.
                    _ => continue,
                },
            };
        }
    }
}

impl ProviderBytes {
    /// The answer's content was read whole (an SSE stream's last event):
    /// what is left of the body is its framing, read in the background so
    /// its connection carries the next call (see the module docs). At most
    /// [`FINISH_MAX_BYTES`] for [`FINISH_TIMEOUT`], and [`MAX_FINISHING`]
    /// at once; past any bound the connection closes, as a dropped body's.
    pub fn finish(self) {
        let Self {
            mut body,
            finishing,
        } = self;
        // Most often the last chunk came with the content: the body ends
        // now and its connection goes back without a task.
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        let mut read = 0;
        if drain(&mut body, &mut cx, &mut read) != Drained::Pending {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(slot) = FinishSlot::take(finishing) else {
            return;
        };
        runtime.spawn(async move {
            let _slot = slot;
            let rest = std::future::poll_fn(|cx| match drain(&mut body, cx, &mut read) {
                Drained::Pending => Poll::Pending,
                _ => Poll::Ready(()),
            });
            let _ = tokio::time::timeout(FINISH_TIMEOUT, rest).await;
            // Dropped here: at its end, its connection goes back.
        });
    }
}

/// How far [`drain`] got.
#[derive(Debug, PartialEq, Eq)]
enum Drained {
    /// The body ended.
    Ended,
    /// It broke, or had more than [`FINISH_MAX_BYTES`] left.
    Abandoned,
    /// More is to come.
    Pending,
}

/// Read what `body` has, counting its bytes in `read`.
fn drain(
    body: &mut UnsyncBoxBody<Bytes, hyper::Error>,
    cx: &mut Context<'_>,
    read: &mut usize,
) -> Drained {
    loop {
        match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Pending => return Drained::Pending,
            Poll::Ready(None) => return Drained::Ended,
            Poll::Ready(Some(Err(_))) => return Drained::Abandoned,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    *read += data.len();
                    if *read > FINISH_MAX_BYTES {
                        return Drained::Abandoned;
                    }
                }
            }
        }
    }
}

/// One of [`MAX_FINISHING`] places, given back when dropped.
struct FinishSlot(Arc<AtomicUsize>);

impl FinishSlot {
    fn take(count: Arc<AtomicUsize>) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_FINISHING).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(count))
    }
}

impl Drop for FinishSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One caller-driven HTTP/1.1 connection: its sender, and the connection
/// itself, polled by whoever uses it.
struct DrivenConn {
    sender: http1::SendRequest<Full<Bytes>>,
    conn: http1::Connection<TokioIo<QuickAckStream>, Full<Bytes>>,
    /// The connection future ended: the connection is closed.
    closed: bool,
}

impl DrivenConn {
    /// Poll the connection (its reads and writes); false once it closed.
    fn poll_conn(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.closed && Pin::new(&mut self.conn).poll(cx).is_ready() {
            self.closed = true;
        }
        !self.closed
    }

    /// Whether it can carry the next request: polled once so it takes in
    /// what the peer sent meanwhile (a close).
    fn reusable(&mut self) -> bool {
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        self.poll_conn(&mut cx) && self.sender.is_ready()
    }
}

/// The process's idle caller-driven connections, by target address.
struct IdleConnections {
    connector: QuickAckConnector,
    idle: Mutex<HashMap<String, Vec<(std::time::Instant, DrivenConn)>>>,
}

impl IdleConnections {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, Vec<(std::time::Instant, DrivenConn)>>> {
        // Each change is one push or pop.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The newest idle connection to `key` that can carry a request; the
    /// expired and closed ones are dropped.
    fn take(&self, key: &str) -> Option<DrivenConn> {
        let mut idle = self.lock();
        let list = idle.get_mut(key)?;
        let now = std::time::Instant::now();
        list.retain(|(since, _)| now.duration_since(*since) < POOL_IDLE_TIMEOUT);
        while let Some((_, mut conn)) = list.pop() {
            if conn.reusable() {
                return Some(conn);
            }
        }
        None
    }

    /// Keep `conn` for the next call to `key`, if it can carry one.
    fn give_back(&self, key: String, mut conn: DrivenConn) {
        if !conn.reusable() {
            return;
        }
        let mut idle = self.lock();
        let list = idle.entry(key).or_default();
        if list.len() >= MAX_IDLE_PER_TARGET {
            list.remove(0);
        }
        list.push((std::time::Instant::now(), conn));
    }

    async fn connect(&self, uri: &Uri) -> Result<DrivenConn, HttpError> {
        let mut connector = self.connector.clone();
        let io = tower_service::Service::call(&mut connector, uri.clone())
            .await
            .map_err(|e| classify(&*e))?;
        let (sender, conn) = http1::handshake(io).await.map_err(|e| classify(&e))?;
        Ok(DrivenConn {
            sender,
            conn,
            closed: false,
        })
    }

    /// Send `request` on an idle connection to its target, or a new one,
    /// polling the connection until the answer's head.
    async fn send(
        self: &Arc<Self>,
        mut request: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, HeaderMap, UnsyncBoxBody<Bytes, hyper::Error>), HttpError> {
        let target = request.uri().clone();
        let Some(authority) = target.authority().cloned() else {
            return Err(HttpError::Builder);
        };
        let key = authority.as_str().to_owned();
        if !request.headers().contains_key(http::header::HOST) {
            let host = HeaderValue::from_str(authority.as_str()).map_err(|_| HttpError::Builder)?;
            request.headers_mut().insert(http::header::HOST, host);
        }
        // The request line names the path only (origin form).
        let path = target
            .path_and_query()
            .map_or("/", http::uri::PathAndQuery::as_str);
        *request.uri_mut() = path.parse().map_err(|_| HttpError::Builder)?;
        loop {
            let (mut conn, reused) = match self.take(&key) {
                Some(conn) => (conn, true),
                None => (self.connect(&target).await?, false),
            };
            let mut sent = std::pin::pin!(conn.sender.try_send_request(request));
            let answered = std::future::poll_fn(|cx| {
                conn.poll_conn(cx);
                sent.as_mut().poll(cx)
            })
            .await;
            match answered {
                Ok(response) => {
                    let (parts, body) = response.into_parts();
                    let body = DrivenBody {
                        body,
                        conn: Some(conn),
                        ended: false,
                        idle: Arc::clone(self),
                        key,
                    };
                    return Ok((parts.status, parts.headers, UnsyncBoxBody::new(body)));
                }
                Err(mut e) => match e.take_message() {
                    // A reused connection closed before the request went
                    // out: nothing reached the provider, so a new one.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(classify(e.error())),
                },
            }
        }
    }
}

/// A caller-driven answer's body: reading it polls its connection, which
/// goes back to the idle ones once the body was read whole (dropped before
/// that, it closes).
struct DrivenBody {
    body: Incoming,
    conn: Option<DrivenConn>,
    ended: bool,
    idle: Arc<IdleConnections>,
    key: String,
}

impl Body for DrivenBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(conn) = this.conn.as_mut() {
            conn.poll_conn(cx);
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            this.ended = true;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for DrivenBody {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take()
            && (self.ended || self.body.is_end_stream())
        {
            self.idle.give_back(std::mem::take(&mut self.key), conn);
        }
    }
}

/// hyper's connector, with every TCP stream a [`QuickAckStream`].
#[derive(Clone)]
struct QuickAckConnector(HttpConnector);

impl tower_service::Service<Uri> for QuickAckConnector {
    type Response = TokioIo<QuickAckStream>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            Ok(TokioIo::new(QuickAckStream(tcp)))
        })
    }
}

/// A TCP stream that acknowledges at once what it reads (`TCP_QUICKACK`
/// after each read that returned data), so a sender with Nagle's algorithm
/// on never waits for a delayed ACK.
pub struct QuickAckStream(TcpStream);

impl QuickAckStream {
    /// Wrap a connected stream.
    pub fn new(tcp: TcpStream) -> Self {
        Self(tcp)
    }
}

impl AsyncRead for QuickAckStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.0).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            // Not permanent: the kernel may go back to delaying ACKs after
            // the next request is sent, so it is set after every read. A
            // failure only costs the delay it would have saved.
            let _ = socket2::SockRef::from(&self.0).set_tcp_quickack(true);
        }
        read
    }
}

impl AsyncWrite for QuickAckStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl Connection for QuickAckStream {
    fn connected(&self) -> Connected {
        self.0.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A ping-pong exchange: the client's socket is `TCP_QUICKACK` after
    /// each of its reads, read back through `stream`.
    async fn exchange<S>(mut stream: S, quickack: impl Fn(&S) -> bool) -> Vec<bool>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut buf = [0u8; 5];
        let mut seen = Vec::new();
        for _ in 0..8 {
            stream.write_all(b"ping!").await.unwrap();
            stream.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"pong!");
            seen.push(quickack(&stream));
        }
        seen
    }

    async fn pong_server() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 5];
            while s.read_exact(&mut buf).await.is_ok() {
                s.write_all(b"pong!").await.unwrap();
            }
        });
        addr
    }

    /// A socket that sends right after it receives goes into the kernel's
    /// delayed-ACK ("interactive") mode, as a pooled provider connection
    /// does with each request; after each read, [`QuickAckStream`] has
    /// taken it out again (`TCP_QUICKACK` reads back as set), the plain
    /// stream has not.
    #[tokio::test]
    async fn a_read_leaves_the_socket_acknowledging_at_once() {
        let plain = TcpStream::connect(pong_server().await).await.unwrap();
        let plain = exchange(plain, |s| socket2::SockRef::from(s).tcp_quickack().unwrap()).await;
        assert!(
            plain.iter().any(|q| !q),
            "a plain socket never entered delayed-ACK mode: {plain:?}"
        );
        let wrapped = QuickAckStream::new(TcpStream::connect(pong_server().await).await.unwrap());
        let wrapped = exchange(wrapped, |s| {
            socket2::SockRef::from(&s.0).tcp_quickack().unwrap()
        })
        .await;
        assert!(wrapped.iter().all(|q| *q), "{wrapped:?}");
    }

    /// An HTTP/1.1 server answering `ok` to each request on a connection,
    /// closing each connection after `per_conn` answers (and saying so on
    /// `closed`); `accepted` counts its connections.
    async fn keep_alive_server(
        per_conn: usize,
    ) -> (
        std::net::SocketAddr,
        Arc<std::sync::atomic::AtomicUsize>,
        tokio::sync::mpsc::UnboundedReceiver<()>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (closed_tx, closed) = tokio::sync::mpsc::unbounded_channel();
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let closed_tx = closed_tx.clone();
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut answered = 0;
                    let mut buf = [0u8; 1024];
                    while answered < per_conn {
                        let Ok(n) = s.read(&mut buf).await else { break };
                        if n == 0 {
                            break;
                        }
                        seen.extend_from_slice(&buf[..n]);
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                .await
                                .unwrap();
                            answered += 1;
                        }
                    }
                    drop(s);
                    let _ = closed_tx.send(());
                });
            }
        });
        (addr, accepted, closed)
    }

    async fn read_whole(http: &ProviderHttp, addr: std::net::SocketAddr) -> Vec<u8> {
        let mut answer = http
            .get(format!("http://{addr}/v1/models"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        let mut body = Vec::new();
        while let Some(piece) = answer.chunk().await.unwrap() {
            body.extend_from_slice(&piece);
        }
        body
    }

    /// A caller-driven call's connection is polled by the caller and kept
    /// once its answer was read whole: the next call reuses it.
    #[tokio::test]
    async fn a_caller_driven_connection_carries_the_next_call_once_read_whole() {
        let (addr, accepted, _closed) = keep_alive_server(usize::MAX).await;
        let http = ProviderHttp::new().caller_driven();
        for _ in 0..3 {
            assert_eq!(read_whole(&http, addr).await, b"ok");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// A kept connection the provider closed meanwhile is not used: the
    /// call goes out on a new one and is answered.
    #[tokio::test]
    async fn a_caller_driven_call_after_the_provider_closed_the_connection_takes_a_new_one() {
        let (addr, accepted, mut closed) = keep_alive_server(1).await;
        let http = ProviderHttp::new().caller_driven();
        assert_eq!(read_whole(&http, addr).await, b"ok");
        closed.recv().await.unwrap();
        assert_eq!(read_whole(&http, addr).await, b"ok");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// An answer dropped before its end closes its connection: the next
    /// call takes a new one.
    #[tokio::test]
    async fn a_caller_driven_answer_dropped_unread_does_not_give_its_connection_back() {
        let (addr, accepted, _closed) = keep_alive_server(usize::MAX).await;
        let http = ProviderHttp::new().caller_driven();
        let answer = http
            .get(format!("http://{addr}/v1/models"))
            .send()
            .await
            .unwrap();
        drop(answer);
        assert_eq!(read_whole(&http, addr).await, b"ok");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// An HTTP/1.1 server answering each request with a chunked body:
    /// `hello` at once, then `rest` (the framing, or more) once `go` says
    /// so; `accepted` counts its connections.
    async fn chunked_server(
        rest: Vec<u8>,
    ) -> (
        std::net::SocketAddr,
        Arc<AtomicUsize>,
        tokio::sync::mpsc::UnboundedSender<()>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (go_tx, go) = tokio::sync::mpsc::unbounded_channel::<()>();
        let go = Arc::new(tokio::sync::Mutex::new(go));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let (go, rest) = (go.clone(), rest.clone());
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        seen.extend_from_slice(&buf[..n]);
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
                            s.write_all(head).await.unwrap();
                            s.write_all(b"5\r\nhello\r\n").await.unwrap();
                            go.lock().await.recv().await.unwrap();
                            if s.write_all(&rest).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, accepted, go_tx)
    }

    /// Read a streamed answer's content (`hello`), then finish it.
    async fn read_content_and_finish(http: &ProviderHttp, addr: std::net::SocketAddr) {
        let answer = http
            .get(format!("http://{addr}/v1/chat/completions"))
            .send()
            .await
            .unwrap();
        let mut bytes = answer.bytes_stream();
        let piece = futures::StreamExt::next(&mut bytes).await.unwrap().unwrap();
        assert_eq!(&piece[..], b"hello");
        bytes.finish();
    }

    /// Until no finished answer is being read.
    async fn finishing_done(http: &ProviderHttp) {
        while http.finishing.load(Ordering::SeqCst) > 0 {
            tokio::task::yield_now().await;
        }
    }

    /// A streamed answer whose content was read whole and whose last chunk
    /// comes later is finished in the background: its connection carries
    /// the next call, on the caller-driven and the pooled client alike.
    #[tokio::test]
    async fn a_finished_answer_whose_last_chunk_comes_later_gives_its_connection_back() {
        for http in [ProviderHttp::new().caller_driven(), ProviderHttp::new()] {
            let (addr, accepted, go) = chunked_server(b"0\r\n\r\n".to_vec()).await;
            for _ in 0..3 {
                read_content_and_finish(&http, addr).await;
                assert_eq!(http.finishing.load(Ordering::SeqCst), 1);
                go.send(()).unwrap();
                finishing_done(&http).await;
            }
            assert_eq!(accepted.load(Ordering::SeqCst), 1);
        }
    }

    /// A finished answer with more than [`FINISH_MAX_BYTES`] left is not
    /// read to its end: its connection closes and the next call takes a
    /// new one.
    #[tokio::test]
    async fn a_finished_answer_with_more_than_its_bound_left_closes_its_connection() {
        let piece = format!("{:x}\r\n{}\r\n", 4096, "x".repeat(4096));
        let mut rest = piece.repeat(FINISH_MAX_BYTES / 4096 + 1).into_bytes();
        rest.extend_from_slice(b"0\r\n\r\n");
        let (addr, accepted, go) = chunked_server(rest).await;
        let http = ProviderHttp::new().caller_driven();
        read_content_and_finish(&http, addr).await;
        go.send(()).unwrap();
        finishing_done(&http).await;
        go.send(()).unwrap();
        read_content_and_finish(&http, addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Finished answers read at once are bounded by [`MAX_FINISHING`]: one
    /// past it closes its connection instead of taking a task.
    #[test]
    fn finishing_places_are_bounded() {
        let count = Arc::new(AtomicUsize::new(0));
        let slots: Vec<_> = (0..MAX_FINISHING)
            .map(|_| FinishSlot::take(count.clone()).unwrap())
            .collect();
        assert!(FinishSlot::take(count.clone()).is_none());
        drop(slots);
        assert_eq!(count.load(Ordering::SeqCst), 0);
        assert!(FinishSlot::take(count).is_some());
    }

    #[tokio::test]
    async fn a_request_with_a_bad_url_or_header_is_a_builder_error() {
        let http = ProviderHttp::new();
        let bad_url = http.get("not a url".into()).send().await;
        assert_eq!(bad_url.err(), Some(HttpError::Builder));
        let bad_header = http
            .get("http://127.0.0.1:9/".into())
            .bearer_auth("line\nbreak")
            .send()
            .await;
        assert_eq!(bad_header.err(), Some(HttpError::Builder));
    }

    #[tokio::test]
    async fn a_refused_connection_is_unreachable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let err = ProviderHttp::new()
            .get(format!("http://{addr}/v1/models"))
            .send()
            .await
            .err();
        assert_eq!(err, Some(HttpError::Unreachable));
    }
}
