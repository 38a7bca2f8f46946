//! rustls configuration for mutual TLS between Edge and Node (SPEC §3).
//!
//! Both sides use the ring provider explicitly, TLS 1.3 only (QUIC requires
//! it) and ALPN [`iop_wire::ALPN`]. No process-default crypto provider is
//! needed.

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

use crate::endpoint::TransportError;
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

/// The Edge's rustls config: presents `cfg.cert_chain`, requires a client
/// certificate chained to `cfg.client_ca`, negotiates ALPN `iop/1`.
pub fn server_config(cfg: &ServerTls) -> Result<rustls::ServerConfig, TransportError> {
    let provider = crypto_provider();
    let roots = Arc::new(root_store(&cfg.client_ca)?);
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(TransportError::ClientVerifier)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(TransportError::LocalTlsConfig)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(cfg.cert_chain.clone(), cfg.key.clone_key())
        .map_err(TransportError::LocalTlsConfig)?;
    config.alpn_protocols = vec![iop_wire::ALPN.to_vec()];
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
