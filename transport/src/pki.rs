//! The deployment PKI: a CA, the Edge's server certificate and one client
//! certificate per Node, plus loading them back as rustls types.
//!
//! Every certificate is ECDSA P-256. Node certificates carry their identity
//! as SAN URI `node://<id>` (and CN = id) and are usable for client auth
//! only; the Edge certificate is usable for server auth only, so neither can
//! stand in for the other.

use std::fs;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::identity::{IdentityError, NODE_URI_PREFIX, validate_node_id};

/// Validity of the dev CA: ten years.
pub const DEV_CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Validity of dev Edge and Node certificates: one year.
pub const DEV_LEAF_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

/// How far [`Validity::from_now`] back-dates `not_before`, so a peer whose
/// clock is slightly behind still accepts a fresh certificate.
pub const CLOCK_SKEW_ALLOWANCE: Duration = Duration::from_secs(3600);

/// The largest instant a certificate may name: 9999-12-31T23:59:59Z, the end
/// of X.509 `GeneralizedTime`.
const LATEST_CERT_TIME_SECS: u64 = 253_402_300_799;

/// File names [`generate_dev_pki`] writes inside its output directory.
pub mod file_names {
    /// The CA certificate (give it to every Edge and Node).
    pub const CA_CERT: &str = "ca.pem";
    /// The CA private key (keep it to issue more node certificates).
    pub const CA_KEY: &str = "ca.key";
    /// The Edge server certificate.
    pub const EDGE_CERT: &str = "edge.pem";
    /// The Edge server private key.
    pub const EDGE_KEY: &str = "edge.key";

    /// `node-<id>.pem`: a Node's client certificate.
    pub fn node_cert(node_id: &str) -> String {
        format!("node-{node_id}.pem")
    }

    /// `node-<id>.key`: a Node's private key.
    pub fn node_key(node_id: &str) -> String {
        format!("node-{node_id}.key")
    }
}

/// Why a certificate could not be generated, written or loaded.
///
/// File variants name the file; argument variants are the caller's fault;
/// [`PkiError::Generate`] is a local failure of the certificate library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PkiError {
    /// A file could not be read (missing, permissions, ...).
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A file or directory could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A file that would be written already exists; nothing is overwritten
    /// (replacing a CA key would orphan every issued certificate).
    #[error("{} already exists; refusing to overwrite it", path.display())]
    AlreadyExists {
        /// The existing file.
        path: PathBuf,
    },
    /// A file is not valid PEM.
    #[error("{} is not valid PEM: {source}", path.display())]
    InvalidPem {
        /// The file.
        path: PathBuf,
        /// What the PEM parser refused.
        source: pem::Error,
    },
    /// A file holds no `CERTIFICATE` section.
    #[error("{} holds no certificate", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A file holds no private key section.
    #[error("{} holds no private key", path.display())]
    NoPrivateKey {
        /// The file.
        path: PathBuf,
    },
    /// A private key file grants access to its group or others.
    #[error(
        "{} has mode {mode:o}; a key file must be mode 0600 or stricter (0640 if root owns it)",
        path.display()
    )]
    InsecureKeyFile {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The CA certificate or key given to an `issue_*` function is unusable
    /// (not PEM, not a certificate, unsupported key).
    #[error("the CA certificate or key is unusable: {0}")]
    InvalidCa(#[source] rcgen::Error),
    /// A node id given by the caller is malformed.
    #[error(transparent)]
    InvalidNodeId(#[from] IdentityError),
    /// The same node id was given twice.
    #[error("node id {0:?} was given twice")]
    DuplicateNodeId(String),
    /// An Edge name given by the caller is neither a DNS name nor an IP.
    #[error("invalid edge name {name:?}: {source}")]
    InvalidEdgeName {
        /// The refused name.
        name: String,
        /// Why rcgen refused it.
        source: rcgen::Error,
    },
    /// The caller's validity window is empty or outside 1970..=9999.
    #[error("invalid validity window: {0}")]
    InvalidValidity(&'static str),
    /// The certificate library failed (a local failure).
    #[error("certificate generation failed: {0}")]
    Generate(#[source] rcgen::Error),
}

/// When a certificate is valid: `not_before ..= not_after` (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// First instant the certificate is valid.
    pub not_before: SystemTime,
    /// Last instant the certificate is valid.
    pub not_after: SystemTime,
}

impl Validity {
    /// Valid from [`CLOCK_SKEW_ALLOWANCE`] ago until `duration` from now.
    pub fn from_now(duration: Duration) -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now.checked_sub(CLOCK_SKEW_ALLOWANCE).unwrap_or(now),
            not_after: now.checked_add(duration).unwrap_or(now),
        }
    }

    /// A window that ended `ago` before now and lasted one day: an expired
    /// certificate (for tests of expiry handling).
    pub fn expired(ago: Duration) -> Self {
        let now = SystemTime::now();
        let not_after = now.checked_sub(ago).unwrap_or(SystemTime::UNIX_EPOCH);
        let not_before = not_after
            .checked_sub(Duration::from_secs(24 * 3600))
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Self {
            not_before,
            not_after,
        }
    }

    fn apply(self, params: &mut CertificateParams) -> Result<(), PkiError> {
        if self.not_after <= self.not_before {
            return Err(PkiError::InvalidValidity(
                "not_after is not after not_before",
            ));
        }
        for instant in [self.not_before, self.not_after] {
            let since_epoch = instant
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_err(|_| PkiError::InvalidValidity("instant before 1970"))?;
            if since_epoch.as_secs() > LATEST_CERT_TIME_SECS {
                return Err(PkiError::InvalidValidity("instant after 9999-12-31"));
            }
        }
        // Both instants are inside 1970..=9999, which the conversion covers.
        params.not_before = self.not_before.into();
        params.not_after = self.not_after.into();
        Ok(())
    }
}

/// A freshly issued certificate and its private key, both PEM.
///
/// `Debug` never prints the key.
#[derive(Clone, PartialEq, Eq)]
pub struct IssuedCert {
    /// The certificate, PEM (`CERTIFICATE`).
    pub cert_pem: String,
    /// The private key, PEM (PKCS#8 `PRIVATE KEY`). A secret.
    pub key_pem: String,
}

impl std::fmt::Debug for IssuedCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedCert")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl IssuedCert {
    /// The certificate as DER.
    pub fn cert_der(&self) -> Result<CertificateDer<'static>, PkiError> {
        CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).map_err(|source| {
            PkiError::InvalidPem {
                path: PathBuf::from("<issued certificate>"),
                source,
            }
        })
    }

    /// Write the certificate to `cert_path` and the key to `key_path`
    /// (owner-only, 0600). Refuses to overwrite either file.
    pub fn write_files(&self, cert_path: &Path, key_path: &Path) -> Result<(), PkiError> {
        for path in [cert_path, key_path] {
            if path.exists() {
                return Err(PkiError::AlreadyExists {
                    path: path.to_owned(),
                });
            }
        }
        write_new_file(cert_path, self.cert_pem.as_bytes(), FileKind::Public)?;
        write_new_file(key_path, self.key_pem.as_bytes(), FileKind::Secret)
    }
}

/// The files [`generate_dev_pki`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevPki {
    /// The output directory.
    pub dir: PathBuf,
    /// `ca.pem`.
    pub ca_cert: PathBuf,
    /// `ca.key` (0600).
    pub ca_key: PathBuf,
    /// `edge.pem`.
    pub edge_cert: PathBuf,
    /// `edge.key` (0600).
    pub edge_key: PathBuf,
    /// One entry per node id, in the order given.
    pub nodes: Vec<NodeCertFiles>,
}

impl DevPki {
    /// The files of one node, if it was generated.
    pub fn node(&self, node_id: &str) -> Option<&NodeCertFiles> {
        self.nodes.iter().find(|n| n.node_id == node_id)
    }
}

/// A Node's certificate and key files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCertFiles {
    /// The node id its certificate carries.
    pub node_id: String,
    /// `node-<id>.pem`.
    pub cert: PathBuf,
    /// `node-<id>.key` (0600).
    pub key: PathBuf,
}

/// Generate a development PKI into `out_dir` (created if missing): a CA,
/// an Edge server certificate for `edge_names` plus `localhost`, 127.0.0.1
/// and ::1, and one client certificate per node id.
///
/// Writes `ca.pem`, `ca.key`, `edge.pem`, `edge.key`, `node-<id>.pem`,
/// `node-<id>.key`; keys are owner-only (0600). Checks every argument and
/// refuses to overwrite any existing file before writing anything.
pub fn generate_dev_pki(
    out_dir: &Path,
    node_ids: &[&str],
    edge_names: &[&str],
) -> Result<DevPki, PkiError> {
    for (i, id) in node_ids.iter().enumerate() {
        validate_node_id(id)?;
        if node_ids[..i].contains(id) {
            return Err(PkiError::DuplicateNodeId((*id).to_owned()));
        }
    }
    let edge_sans = edge_subject_alt_names(edge_names)?;

    let dir = out_dir.to_owned();
    let pki = DevPki {
        ca_cert: dir.join(file_names::CA_CERT),
        ca_key: dir.join(file_names::CA_KEY),
        edge_cert: dir.join(file_names::EDGE_CERT),
        edge_key: dir.join(file_names::EDGE_KEY),
        nodes: node_ids
            .iter()
            .map(|id| NodeCertFiles {
                node_id: (*id).to_owned(),
                cert: dir.join(file_names::node_cert(id)),
                key: dir.join(file_names::node_key(id)),
            })
            .collect(),
        dir,
    };
    let mut targets = vec![&pki.ca_cert, &pki.ca_key, &pki.edge_cert, &pki.edge_key];
    targets.extend(pki.nodes.iter().flat_map(|n| [&n.cert, &n.key]));
    if let Some(existing) = targets.into_iter().find(|p| p.exists()) {
        return Err(PkiError::AlreadyExists {
            path: existing.clone(),
        });
    }

    let ca = generate_ca("iop dev CA", Validity::from_now(DEV_CA_VALIDITY))?;
    let leaf_validity = Validity::from_now(DEV_LEAF_VALIDITY);
    let issuer = ca_issuer(&ca.cert_pem, &ca.key_pem)?;
    let edge = issue_leaf(
        &issuer,
        "iop edge",
        edge_sans,
        LeafUse::Server,
        leaf_validity,
    )?;
    let nodes = node_ids
        .iter()
        .map(|id| issue_leaf(&issuer, id, node_sans(id)?, LeafUse::Client, leaf_validity))
        .collect::<Result<Vec<_>, _>>()?;

    fs::create_dir_all(&pki.dir).map_err(|source| PkiError::Write {
        path: pki.dir.clone(),
        source,
    })?;
    ca.write_files(&pki.ca_cert, &pki.ca_key)?;
    edge.write_files(&pki.edge_cert, &pki.edge_key)?;
    for (files, issued) in pki.nodes.iter().zip(&nodes) {
        issued.write_files(&files.cert, &files.key)?;
    }
    Ok(pki)
}

/// Generate a self-signed CA (CA:true, path length 0: it issues leaves
/// only).
pub fn generate_ca(common_name: &str, validity: Validity) -> Result<IssuedCert, PkiError> {
    let key = KeyPair::generate().map_err(PkiError::Generate)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = common_name_dn(common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity.apply(&mut params)?;
    let cert = params.self_signed(&key).map_err(PkiError::Generate)?;
    Ok(IssuedCert {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Issue a Node client certificate carrying `node://<node_id>` (and CN =
/// node id), signed by the CA given as PEM.
pub fn issue_node_cert(
    ca_cert_pem: &str,
    ca_key_pem: &str,
    node_id: &str,
    validity: Validity,
) -> Result<IssuedCert, PkiError> {
    validate_node_id(node_id)?;
    let issuer = ca_issuer(ca_cert_pem, ca_key_pem)?;
    issue_leaf(
        &issuer,
        node_id,
        node_sans(node_id)?,
        LeafUse::Client,
        validity,
    )
}

/// Issue one more node's certificate with the CA kept in `dir`
/// (`ca.pem`, `ca.key`), writing `node-<id>.pem` and `node-<id>.key` there.
pub fn issue_node_files(dir: &Path, node_id: &str, days: u64) -> Result<NodeCertFiles, PkiError> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(|source| PkiError::Read { path, source })
    };
    let ca_cert = read(file_names::CA_CERT)?;
    let ca_key = read(file_names::CA_KEY)?;
    let validity = Validity::from_now(Duration::from_secs(days.saturating_mul(86_400)));
    let issued = issue_node_cert(&ca_cert, &ca_key, node_id, validity)?;
    let files = NodeCertFiles {
        node_id: node_id.to_owned(),
        cert: dir.join(file_names::node_cert(node_id)),
        key: dir.join(file_names::node_key(node_id)),
    };
    issued.write_files(&files.cert, &files.key)?;
    Ok(files)
}

/// Issue a client certificate that chains to the CA but carries no node
/// identity (only CN = `common_name`).
///
/// It exists so tests can prove the Edge refuses such a certificate; a
/// deployment has no use for it.
pub fn issue_client_cert_without_node_identity(
    ca_cert_pem: &str,
    ca_key_pem: &str,
    common_name: &str,
    validity: Validity,
) -> Result<IssuedCert, PkiError> {
    let issuer = ca_issuer(ca_cert_pem, ca_key_pem)?;
    issue_leaf(&issuer, common_name, Vec::new(), LeafUse::Client, validity)
}

/// Load every certificate in a PEM file, leaf first.
pub fn load_cert_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(PkiError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The permission bits of a secret file (a key, an API key, a credential)
/// if they grant anything to its group or others: such a file is refused,
/// the process must not run with a secret other users could have read.
/// `Ok(None)` when the mode is 0600 or stricter (and on non-Unix systems).
pub fn insecure_secret_file_mode(path: &Path) -> io::Result<Option<u32>> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(path)?.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Ok(Some(mode));
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(None)
}

/// The permission bits of a secret file an administrator provides (a TLS
/// key, an API key, a credential) if they grant more than they may:
/// anything to others, or anything to its group unless the file belongs to
/// root and its group may only read it (0640 or 0440, PostgreSQL's rule):
/// root chose who shares it, as the kubelet does for a Secret volume with
/// `fsGroup` (root-owned, group-readable) and Debian's `ssl-cert` group.
/// `Ok(None)` when the file passes (and on non-Unix systems). Keys the
/// process makes itself are held to [`insecure_secret_file_mode`].
pub fn insecure_provided_secret_mode(path: &Path) -> io::Result<Option<u32>> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path)?;
        let mode = meta.mode() & 0o777;
        let shared_by_root = meta.uid() == 0 && mode & 0o070 & !0o040 == 0;
        if mode & 0o007 != 0 || (mode & 0o070 != 0 && !shared_by_root) {
            return Ok(Some(mode));
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(None)
}

/// Load the first private key (PKCS#8, PKCS#1 or SEC1) in a PEM file; a
/// file readable by others, or by its group unless root owns it, is
/// refused ([`insecure_provided_secret_mode`]).
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, PkiError> {
    match insecure_provided_secret_mode(path) {
        Ok(None) => {}
        Ok(Some(mode)) => {
            return Err(PkiError::InsecureKeyFile {
                path: path.to_owned(),
                mode,
            });
        }
        Err(source) => {
            return Err(PkiError::Read {
                path: path.to_owned(),
                source,
            });
        }
    }
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        pem::Error::NoItemsFound => PkiError::NoPrivateKey {
            path: path.to_owned(),
        },
        other => pem_error(path, other),
    })
}

/// Load the deployment CA certificate(s) that peers must chain to.
pub fn load_ca(path: &Path) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    load_cert_chain(path)
}

/// What a leaf certificate may authenticate.
#[derive(Debug, Clone, Copy)]
enum LeafUse {
    Client,
    Server,
}

fn issue_leaf(
    issuer: &Issuer<'_, KeyPair>,
    common_name: &str,
    sans: Vec<SanType>,
    leaf_use: LeafUse,
    validity: Validity,
) -> Result<IssuedCert, PkiError> {
    let key = KeyPair::generate().map_err(PkiError::Generate)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = common_name_dn(common_name);
    params.subject_alt_names = sans;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![match leaf_use {
        LeafUse::Client => ExtendedKeyUsagePurpose::ClientAuth,
        LeafUse::Server => ExtendedKeyUsagePurpose::ServerAuth,
    }];
    params.use_authority_key_identifier_extension = true;
    validity.apply(&mut params)?;
    let cert = params.signed_by(&key, issuer).map_err(PkiError::Generate)?;
    Ok(IssuedCert {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

fn ca_issuer(ca_cert_pem: &str, ca_key_pem: &str) -> Result<Issuer<'static, KeyPair>, PkiError> {
    let key = KeyPair::from_pem(ca_key_pem).map_err(PkiError::InvalidCa)?;
    Issuer::from_ca_cert_pem(ca_cert_pem, key).map_err(PkiError::InvalidCa)
}

fn common_name_dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

fn node_sans(node_id: &str) -> Result<Vec<SanType>, PkiError> {
    let uri = format!("{NODE_URI_PREFIX}{node_id}");
    // A validated node id is ASCII, so this conversion cannot fail; map the
    // error anyway rather than assume it.
    let uri = uri.try_into().map_err(PkiError::Generate)?;
    Ok(vec![SanType::URI(uri)])
}

fn edge_subject_alt_names(names: &[&str]) -> Result<Vec<SanType>, PkiError> {
    let mut sans = Vec::with_capacity(names.len() + 3);
    for name in names.iter().copied().chain(["localhost"]) {
        let san =
            match name.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(name.try_into().map_err(|source| {
                    PkiError::InvalidEdgeName {
                        name: name.to_owned(),
                        source,
                    }
                })?),
            };
        if !sans.contains(&san) {
            sans.push(san);
        }
    }
    for ip in [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ] {
        let san = SanType::IpAddress(ip);
        if !sans.contains(&san) {
            sans.push(san);
        }
    }
    Ok(sans)
}

fn pem_error(path: &Path, error: pem::Error) -> PkiError {
    match error {
        pem::Error::Io(source) => PkiError::Read {
            path: path.to_owned(),
            source,
        },
        source => PkiError::InvalidPem {
            path: path.to_owned(),
            source,
        },
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileKind {
    Public,
    Secret,
}

/// Create `path` (never overwriting) and write `contents`; secrets are
/// created owner-only, so the key is never readable by others, not even
/// briefly.
fn write_new_file(path: &Path, contents: &[u8], kind: FileKind) -> Result<(), PkiError> {
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(match kind {
            FileKind::Secret => 0o600,
            FileKind::Public => 0o644,
        });
    }
    #[cfg(not(unix))]
    let _ = kind;
    let write_error = |source| PkiError::Write {
        path: path.to_owned(),
        source,
    };
    let mut file = options.open(path).map_err(|source| {
        if source.kind() == io::ErrorKind::AlreadyExists {
            PkiError::AlreadyExists {
                path: path.to_owned(),
            }
        } else {
            write_error(source)
        }
    })?;
    file.write_all(contents).map_err(write_error)?;
    file.sync_all().map_err(write_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::node_id_from_cert;

    fn tempdir() -> tempfile::TempDir {
        match tempfile::tempdir() {
            Ok(dir) => dir,
            Err(e) => panic!("tempdir: {e}"),
        }
    }

    #[test]
    fn a_private_key_readable_by_others_or_an_unchosen_group_is_refused() -> Result<(), PkiError> {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let dir = tempdir();
        let pki = generate_dev_pki(&dir.path().join("pki"), &["n"], &[])?;
        load_private_key(&pki.edge_key)?;
        let key = &pki.edge_key;
        let chmod = |mode: u32| {
            std::fs::set_permissions(key, std::fs::Permissions::from_mode(mode)).map_err(|source| {
                PkiError::Write {
                    path: key.clone(),
                    source,
                }
            })
        };
        for mode in [0o644, 0o604, 0o660, 0o620] {
            chmod(mode)?;
            assert!(
                matches!(
                    load_private_key(key),
                    Err(PkiError::InsecureKeyFile { mode: m, .. }) if m == mode
                ),
                "mode {mode:o}"
            );
        }
        // Group-readable: only when root owns the file (it chose the group).
        chmod(0o640)?;
        let owned_by_root = std::fs::metadata(key)
            .map(|m| m.uid() == 0)
            .unwrap_or(false);
        assert_eq!(load_private_key(key).is_ok(), owned_by_root);
        if owned_by_root {
            // Root can hand the file to another user: then it is refused.
            std::os::unix::fs::chown(key, Some(65_534), None).map_err(|source| {
                PkiError::Write {
                    path: key.clone(),
                    source,
                }
            })?;
            assert!(matches!(
                load_private_key(key),
                Err(PkiError::InsecureKeyFile { mode: 0o640, .. })
            ));
        }
        Ok(())
    }

    #[test]
    fn dev_pki_writes_every_file_with_owner_only_keys() -> Result<(), PkiError> {
        let dir = tempdir();
        let out = dir.path().join("pki");
        let pki = generate_dev_pki(&out, &["n1", "gpu.box-2"], &["edge.example.com"])?;
        let names: Vec<_> = ["ca.pem", "ca.key", "edge.pem", "edge.key"]
            .into_iter()
            .map(String::from)
            .chain(
                ["n1", "gpu.box-2"]
                    .into_iter()
                    .flat_map(|id| [file_names::node_cert(id), file_names::node_key(id)]),
            )
            .collect();
        for name in &names {
            assert!(out.join(name).is_file(), "{name} missing");
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for key in [
                &pki.ca_key,
                &pki.edge_key,
                &pki.nodes[0].key,
                &pki.nodes[1].key,
            ] {
                let mode = fs::metadata(key)
                    .map_err(|source| PkiError::Read {
                        path: key.clone(),
                        source,
                    })?
                    .permissions()
                    .mode();
                assert_eq!(mode & 0o777, 0o600, "{}", key.display());
            }
        }
        let node = load_cert_chain(&pki.nodes[1].cert)?;
        assert_eq!(node_id_from_cert(&node[0]), Ok("gpu.box-2".to_owned()));
        load_private_key(&pki.edge_key)?;
        assert_eq!(load_ca(&pki.ca_cert)?.len(), 1);
        Ok(())
    }

    #[test]
    fn dev_pki_refuses_to_overwrite_and_bad_arguments() -> Result<(), PkiError> {
        let dir = tempdir();
        generate_dev_pki(dir.path(), &["n1"], &[])?;
        assert!(matches!(
            generate_dev_pki(dir.path(), &["n2"], &[]),
            Err(PkiError::AlreadyExists { .. })
        ));
        let other = dir.path().join("other");
        assert!(matches!(
            generate_dev_pki(&other, &["n1", "n1"], &[]),
            Err(PkiError::DuplicateNodeId(_))
        ));
        assert!(matches!(
            generate_dev_pki(&other, &["bad id"], &[]),
            Err(PkiError::InvalidNodeId(_))
        ));
        assert!(!other.exists(), "nothing is written when arguments are bad");
        Ok(())
    }

    #[test]
    fn more_nodes_can_be_issued_from_the_saved_ca() -> Result<(), PkiError> {
        let dir = tempdir();
        let pki = generate_dev_pki(dir.path(), &[], &[])?;
        let read = |path: &Path| {
            fs::read_to_string(path).map_err(|source| PkiError::Read {
                path: path.to_owned(),
                source,
            })
        };
        let issued = issue_node_cert(
            &read(&pki.ca_cert)?,
            &read(&pki.ca_key)?,
            "late-node",
            Validity::from_now(DEV_LEAF_VALIDITY),
        )?;
        assert_eq!(
            node_id_from_cert(&issued.cert_der()?),
            Ok("late-node".to_owned())
        );
        assert!(!format!("{issued:?}").contains("PRIVATE KEY"));
        Ok(())
    }

    #[test]
    fn loading_names_the_file_that_failed() {
        let dir = tempdir();
        let missing = dir.path().join("missing.pem");
        let err = load_cert_chain(&missing).err();
        assert!(matches!(&err, Some(PkiError::Read { path, .. }) if *path == missing));

        let empty = dir.path().join("empty.pem");
        assert!(fs::write(&empty, "no pem here\n").is_ok());
        let err = load_cert_chain(&empty).err();
        assert!(matches!(&err, Some(PkiError::NoCertificate { path }) if *path == empty));
        {
            use std::os::unix::fs::PermissionsExt as _;
            let owner_only = fs::Permissions::from_mode(0o600);
            assert!(fs::set_permissions(&empty, owner_only).is_ok());
        }
        let err = load_private_key(&empty).err();
        assert!(matches!(&err, Some(PkiError::NoPrivateKey { path }) if *path == empty));
        assert!(
            err.map(|e| e.to_string())
                .is_some_and(|s| s.contains("empty.pem"))
        );
    }

    #[test]
    fn inverted_or_out_of_range_validity_is_refused() {
        let now = SystemTime::now();
        let inverted = Validity {
            not_before: now,
            not_after: now,
        };
        assert!(matches!(
            generate_ca("x", inverted),
            Err(PkiError::InvalidValidity(_))
        ));
        let far = Validity {
            not_before: now,
            not_after: SystemTime::UNIX_EPOCH + Duration::from_secs(LATEST_CERT_TIME_SECS + 1),
        };
        assert!(matches!(
            generate_ca("x", far),
            Err(PkiError::InvalidValidity(_))
        ));
    }
}
