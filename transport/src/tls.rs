//! rustls configuration for mutual TLS between Edge and Node (SPEC §3).
//!
//! Both sides use the ring provider explicitly, TLS 1.3 only (QUIC requires
//! it) and ALPN [`iop_wire::ALPN`]. No process-default crypto provider is
//! needed.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use sha2::{Digest as _, Sha256};

use crate::error::TransportError;
use crate::pki::{PkiError, load_ca, load_cert_chain, load_private_key};

/// What the Edge presents and whom it accepts.
#[derive(Debug)]
pub struct ServerTls {
    /// The Edge certificate, leaf first.
    pub cert_chain: Vec<CertificateDer<'static>>,
    /// The Edge private key.
    pub key: PrivateKeyDer<'static>,
    /// The deployment CA: every Node certificate must chain to one of these.
    pub client_ca: Vec<CertificateDer<'static>>,
}

impl ServerTls {
    /// Load the Edge certificate, key and the deployment CA from PEM files.
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, PkiError> {
        Ok(Self {
            cert_chain: load_cert_chain(cert)?,
            key: load_private_key(key)?,
            client_ca: load_ca(ca)?,
        })
    }
}

/// What a Node presents and whom it trusts.
#[derive(Debug)]
pub struct ClientTls {
    /// The Node certificate (carrying `node://<id>`), leaf first.
    pub cert_chain: Vec<CertificateDer<'static>>,
    /// The Node private key.
    pub key: PrivateKeyDer<'static>,
    /// The deployment CA: the Edge certificate must chain to one of these.
    pub server_ca: Vec<CertificateDer<'static>>,
}

impl ClientTls {
    /// Load the Node certificate, key and the deployment CA from PEM files.
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, PkiError> {
        Ok(Self {
            cert_chain: load_cert_chain(cert)?,
            key: load_private_key(key)?,
            server_ca: load_ca(ca)?,
        })
    }
}

/// The crypto provider every iop TLS config uses: ring.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A SHA-256 fingerprint of a certificate's DER encoding.
pub type CertFingerprint = [u8; 32];

/// The SHA-256 fingerprint of `cert` (what `openssl x509 -outform der |
/// sha256sum` prints).
pub fn cert_fingerprint(cert: &CertificateDer<'_>) -> CertFingerprint {
    Sha256::digest(cert.as_ref()).into()
}

/// Parse a fingerprint written as 64 hex digits, optionally separated by
/// `:` (either case).
pub fn parse_fingerprint(text: &str) -> Option<CertFingerprint> {
    let hex: Vec<u8> = text.bytes().filter(|b| *b != b':').collect();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.chunks(2).enumerate() {
        let text = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(text, 16).ok()?;
    }
    Some(out)
}

/// Node certificates the Edge refuses although they chain to the CA: a
/// revoked (lost, leaked) node's certificate, by fingerprint. Shared with
/// the TLS verifier, so [`CertDenylist::replace`] (a reload) applies to
/// the next handshake; [`enforce_denylist`] applies it to a connection
/// already open.
#[derive(Debug, Clone)]
pub struct CertDenylist {
    entries: Arc<RwLock<HashSet<CertFingerprint>>>,
    /// Bumped on every replace.
    version: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for CertDenylist {
    fn default() -> Self {
        Self {
            entries: Arc::default(),
            version: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }
}

impl CertDenylist {
    /// A denylist of `fingerprints`.
    pub fn new(fingerprints: impl IntoIterator<Item = CertFingerprint>) -> Self {
        let list = Self::default();
        list.replace(fingerprints);
        list
    }

    /// Replace every entry.
    pub fn replace(&self, fingerprints: impl IntoIterator<Item = CertFingerprint>) {
        *self.entries.write().unwrap_or_else(|e| e.into_inner()) =
            fingerprints.into_iter().collect();
        self.version.send_modify(|v| *v += 1);
    }

    /// Whether `cert` is denied.
    pub fn denies(&self, cert: &CertificateDer<'_>) -> bool {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&cert_fingerprint(cert))
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves once `cert` is denied (at once if it already is).
    pub async fn denied(&self, cert: &CertificateDer<'_>) {
        let mut changes = self.version.subscribe();
        loop {
            if self.denies(cert) {
                return;
            }
            if changes.changed().await.is_err() {
                // The list can no longer change.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Close `conn` with `unauthorized` as soon as its peer's leaf certificate
/// is on `denylist` (at once if it already is), or expires; ends with the
/// connection. The Edge runs one per node connection, so a revocation (a
/// SIGHUP reload) or an expiry ends a connection already open, not only
/// the next handshake (R-LIM-1's maximum age, for node connections: a
/// certificate's own lifetime).
pub async fn enforce_denylist(conn: quinn::Connection, denylist: CertDenylist) {
    let leaf = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|chain| chain.first().cloned());
    let Some(leaf) = leaf else {
        return;
    };
    let not_after = crate::identity::cert_not_after_unix(&leaf);
    tokio::select! {
        () = denylist.denied(&leaf) => {
            tracing::warn!(
                event = "edge_revoked_node_connection_closed",
                fingerprint = %hex(&cert_fingerprint(&leaf))
            );
            crate::close_connection(&conn, iop_wire::CloseCode::Unauthorized);
        }
        () = expiry(not_after) => {
            tracing::warn!(
                event = "edge_expired_node_connection_closed",
                fingerprint = %hex(&cert_fingerprint(&leaf))
            );
            crate::close_connection(&conn, iop_wire::CloseCode::Unauthorized);
        }
        _ = conn.closed() => {}
    }
}

/// Resolves once the wall clock is past `not_after` (Unix seconds; the
/// certificate is valid through that second); never without one. Sleeps
/// at most an hour at a time and reads the clock again, so a long-lived
/// certificate or a clock step is handled.
async fn expiry(not_after: Option<i64>) {
    let Some(not_after) = not_after else {
        return std::future::pending().await;
    };
    let end_ms = u64::try_from(not_after.saturating_add(1))
        .unwrap_or(0)
        .saturating_mul(1000);
    loop {
        let now = crate::clock::unix_ms();
        if now >= end_ms {
            return;
        }
        let wait = std::time::Duration::from_millis(end_ms - now)
            .min(std::time::Duration::from_secs(3600));
        tokio::time::sleep(wait).await;
    }
}

/// The CA's verifier, then the denylist.
#[derive(Debug)]
struct DenylistVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    denylist: CertDenylist,
}

impl ClientCertVerifier for DenylistVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if self.denylist.denies(end_entity) {
            tracing::warn!(
                event = "edge_revoked_node_certificate_refused",
                fingerprint = %hex(&cert_fingerprint(end_entity))
            );
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked,
            ));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The Edge's rustls config: presents `cfg.cert_chain`, requires a client
/// certificate chained to `cfg.client_ca`, negotiates ALPN `iop/1`.
pub fn server_config(cfg: &ServerTls) -> Result<rustls::ServerConfig, TransportError> {
    server_config_with_denylist(cfg, CertDenylist::default())
}

/// [`server_config`], refusing node certificates on `denylist` as well.
pub fn server_config_with_denylist(
    cfg: &ServerTls,
    denylist: CertDenylist,
) -> Result<rustls::ServerConfig, TransportError> {
    let provider = crypto_provider();
    let roots = Arc::new(root_store(&cfg.client_ca)?);
    let inner = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(TransportError::ClientVerifier)?;
    let verifier = Arc::new(DenylistVerifier { inner, denylist });
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(TransportError::LocalTlsConfig)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(cfg.cert_chain.clone(), cfg.key.clone_key())
        .map_err(TransportError::LocalTlsConfig)?;
    config.alpn_protocols = vec![iop_wire::ALPN.to_vec()];
    // No session resumption: a resumed handshake skips the client
    // certificate's verification, so a node whose certificate expired or
    // was revoked could come back on a ticket of its last connection.
    // Every node connection proves its certificate again.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(config)
}

/// The Node's rustls config: verifies the Edge against `cfg.server_ca`,
/// presents `cfg.cert_chain`, negotiates ALPN `iop/1`.
pub fn client_config(cfg: &ClientTls) -> Result<rustls::ClientConfig, TransportError> {
    let roots = root_store(&cfg.server_ca)?;
    let mut config = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(TransportError::LocalTlsConfig)?
        .with_root_certificates(roots)
        .with_client_auth_cert(cfg.cert_chain.clone(), cfg.key.clone_key())
        .map_err(TransportError::LocalTlsConfig)?;
    config.alpn_protocols = vec![iop_wire::ALPN.to_vec()];
    Ok(config)
}

fn root_store(ca: &[CertificateDer<'static>]) -> Result<RootCertStore, TransportError> {
    if ca.is_empty() {
        return Err(TransportError::NoTrustAnchor);
    }
    let mut roots = RootCertStore::empty();
    for cert in ca {
        roots
            .add(cert.clone())
            .map_err(TransportError::InvalidTrustAnchor)?;
    }
    Ok(roots)
}
