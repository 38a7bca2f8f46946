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
//! Not supported, on purpose: `HTTP_PROXY`/`HTTPS_PROXY` (a provider is
//! reached directly), redirects (a tunnel passes them through as they are),
//! response decompression (tunnelled bodies stay as the provider sent them).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use http::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyDataStream, BodyExt, Full};
use hyper::body::Incoming;
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
        let connector = HttpsConnector::from((QuickAckConnector(http), tls));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(connector);
        Self { client }
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
            body,
        })
    }
}

/// A failed send: a connect that timed out, or unreachable.
fn classify(err: &hyper_util::client::legacy::Error) -> HttpError {
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
    body: Incoming,
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
    pub fn bytes_stream(self) -> impl Stream<Item = Result<Bytes, HttpError>> + Send + 'static {
        futures::StreamExt::map(BodyDataStream::new(self.body), |piece| {
            piece.map_err(|_| HttpError::Body)
        })
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
