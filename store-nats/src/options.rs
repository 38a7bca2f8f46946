//! How to reach the server and which stream and bucket to use.

use std::path::PathBuf;
use std::time::Duration;

use iop_core::journal::JournalLimits;

use crate::ConnectError;

/// How the store authenticates to the server. `Debug` never shows a
/// password or a token.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A NATS credentials file (user JWT and NKey seed).
    CredentialsFile(PathBuf),
    /// User and password.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
    /// A token.
    Token(String),
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::CredentialsFile(path) => {
                f.debug_tuple("CredentialsFile").field(path).finish()
            }
            NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"<redacted>")
                .finish(),
            NatsAuth::Token(_) => f.write_str("Token(<redacted>)"),
        }
    }
}

/// The options of [`NatsStore::connect`](crate::NatsStore::connect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsOptions {
    /// Server URLs (`nats://host:port`, `tls://host:port`); at least one.
    pub servers: Vec<String>,
    /// Credentials.
    pub auth: NatsAuth,
    /// A PEM file of CA certificates to trust; setting it requires TLS.
    pub tls_ca_file: Option<PathBuf>,
    /// A client certificate and its key (PEM files) presented to a server
    /// that verifies its clients (mutual TLS); setting it requires TLS.
    pub tls_client_cert: Option<(PathBuf, PathBuf)>,
    /// The stream of events and requests (created if missing).
    pub stream: String,
    /// The key-value bucket of records, epochs and idempotency keys
    /// (created if missing; its stream is `KV_<bucket>`).
    pub bucket: String,
    /// Subjects of the stream: `<prefix>.ev.<id>` (events) and
    /// `<prefix>.req.<id>` (requests).
    pub subject_prefix: String,
    /// The journal's limits (R-JRN-5), as every store applies them.
    pub limits: JournalLimits,
    /// The events stream's `max_bytes` (discard new: the hard stop).
    pub stream_max_bytes: u64,
    /// Room kept free in the events stream for the records already
    /// accepted: a create is refused (`Full`) once fewer bytes than this
    /// are left.
    pub stream_reserve_bytes: u64,
    /// The bucket's `max_bytes` (discard new: the hard stop).
    pub bucket_max_bytes: u64,
    /// Room kept free in the bucket, as `stream_reserve_bytes`.
    pub bucket_reserve_bytes: u64,
    /// Replicas of the stream and the bucket (1, 3 or 5; a cluster for
    /// more than 1).
    pub replicas: usize,
    /// How long to wait to connect and to load the bucket at start.
    pub connect_timeout: Duration,
    /// How long to wait for any one server answer (an ack, a read).
    pub request_timeout: Duration,
    /// The largest message the store writes; `None`: what the server
    /// allows (its `max_payload`), less room for headers.
    pub max_message_bytes: Option<usize>,
    /// How old the stream and bucket sizes may be when a create checks
    /// the room left.
    pub usage_refresh: Duration,
    /// How long a delete marker stays in the bucket before a sweep purges
    /// it: longer than any Edge's bucket watch may lag.
    pub marker_grace: Duration,
    /// The `max_bytes` of each of the tenants' buckets
    /// ([`NatsStore::tenant_store`](crate::NatsStore::tenant_store):
    /// `<bucket>_rates`, `_budgets`, `_usage`, `_keys`); a write past it
    /// is refused.
    pub tenant_bucket_max_bytes: u64,
}

impl NatsOptions {
    /// Defaults for `limits` on a local server: stream `IOP_JOURNAL`,
    /// bucket `iop_journal`, subjects `iop.journal.*`; the stream may hold
    /// four times the journal's bound and takes no new record past two,
    /// the bucket twice and one.
    pub fn new(servers: Vec<String>, limits: JournalLimits) -> Self {
        NatsOptions {
            servers,
            auth: NatsAuth::None,
            tls_ca_file: None,
            tls_client_cert: None,
            stream: "IOP_JOURNAL".into(),
            bucket: "iop_journal".into(),
            subject_prefix: "iop.journal".into(),
            limits,
            stream_max_bytes: limits.max_bytes.saturating_mul(4),
            stream_reserve_bytes: limits.max_bytes.saturating_mul(2),
            bucket_max_bytes: limits.max_bytes.saturating_mul(2),
            bucket_reserve_bytes: limits.max_bytes,
            replicas: 1,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            max_message_bytes: None,
            usage_refresh: Duration::from_secs(1),
            marker_grace: Duration::from_secs(15 * 60),
            tenant_bucket_max_bytes: 256 << 20,
        }
    }

    /// Whether TLS is required on every connection (a CA or a client
    /// certificate is set, or every server URL is `tls://`).
    pub fn tls_required(&self) -> bool {
        self.tls_ca_file.is_some()
            || self.tls_client_cert.is_some()
            || (!self.servers.is_empty() && self.servers.iter().all(|s| s.starts_with("tls://")))
    }

    /// The servers a password or a token would be sent to in the clear:
    /// `nats://` URLs when TLS is not required and the store
    /// authenticates with a password or a token (a credentials file signs
    /// a server nonce; its seed never leaves the process).
    pub fn plaintext_secret_servers(&self) -> Vec<&str> {
        let secret = matches!(
            self.auth,
            NatsAuth::UserPassword { .. } | NatsAuth::Token(_)
        );
        if !secret || self.tls_required() {
            return Vec::new();
        }
        self.servers
            .iter()
            .filter(|s| !s.starts_with("tls://"))
            .map(String::as_str)
            .collect()
    }

    /// Check the options; the error names the field.
    pub fn validate(&self) -> Result<(), ConnectError> {
        let bad =
            |field: &'static str, reason: String| Err(ConnectError::Options { field, reason });
        if self.servers.is_empty() {
            return bad("servers", "at least one server URL".into());
        }
        for server in &self.servers {
            if let Err(e) = server.parse::<async_nats::ServerAddr>() {
                return bad("servers", format!("{server}: {e}"));
            }
        }
        if let Err(e) = self.limits.validate() {
            return bad("limits", e.to_string());
        }
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if !name_ok(&self.stream) {
            return bad("stream", "letters, digits, '-' and '_' only".into());
        }
        if !name_ok(&self.bucket) {
            return bad("bucket", "letters, digits, '-' and '_' only".into());
        }
        if self.subject_prefix.is_empty() || self.subject_prefix.split('.').any(|t| !name_ok(t)) {
            return bad(
                "subject_prefix",
                "dot-separated tokens of letters, digits, '-' and '_'".into(),
            );
        }
        if self.stream_reserve_bytes >= self.stream_max_bytes {
            return bad(
                "stream_reserve_bytes",
                format!("must be below stream_max_bytes ({})", self.stream_max_bytes),
            );
        }
        if self.bucket_reserve_bytes >= self.bucket_max_bytes {
            return bad(
                "bucket_reserve_bytes",
                format!("must be below bucket_max_bytes ({})", self.bucket_max_bytes),
            );
        }
        if i64::try_from(self.stream_max_bytes).is_err() {
            return bad("stream_max_bytes", "at most i64::MAX".into());
        }
        if i64::try_from(self.bucket_max_bytes).is_err() {
            return bad("bucket_max_bytes", "at most i64::MAX".into());
        }
        if self.tenant_bucket_max_bytes == 0 || i64::try_from(self.tenant_bucket_max_bytes).is_err()
        {
            return bad("tenant_bucket_max_bytes", "between 1 and i64::MAX".into());
        }
        if ![1, 3, 5].contains(&self.replicas) {
            return bad("replicas", format!("1, 3 or 5, got {}", self.replicas));
        }
        if self
            .max_message_bytes
            .is_some_and(|n| n < MIN_MESSAGE_BYTES)
        {
            return bad("max_message_bytes", format!("at least {MIN_MESSAGE_BYTES}"));
        }
        if self.request_timeout.is_zero() {
            return bad("request_timeout", "must be positive".into());
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout", "must be positive".into());
        }
        Ok(())
    }
}

/// The smallest message size the store works with.
pub const MIN_MESSAGE_BYTES: usize = 1024;

/// Bytes of a server's `max_payload` left for headers and subject.
pub(crate) const HEADER_ROOM_BYTES: usize = 512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_each_bad_field_is_named() {
        let ok = NatsOptions::new(
            vec!["nats://127.0.0.1:4222".into()],
            JournalLimits::default(),
        );
        assert_eq!(ok.validate().map_err(|e| e.to_string()), Ok(()));
        let field = |o: NatsOptions| match o.validate() {
            Err(ConnectError::Options { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let mut o = ok.clone();
        o.servers.clear();
        assert_eq!(field(o), "servers");
        let mut o = ok.clone();
        o.servers = vec!["ftp://[::1".into()];
        assert_eq!(field(o), "servers");
        let mut o = ok.clone();
        o.auth = NatsAuth::UserPassword {
            user: "u".into(),
            password: "SECRET-PASSWORD".into(),
        };
        assert!(!format!("{o:?}").contains("SECRET"), "{o:?}");
        o.auth = NatsAuth::Token("SECRET-TOKEN".into());
        assert!(!format!("{o:?}").contains("SECRET"), "{o:?}");
        let mut o = ok.clone();
        o.bucket = "a.b".into();
        assert_eq!(field(o), "bucket");
        let mut o = ok.clone();
        o.subject_prefix = "a..b".into();
        assert_eq!(field(o), "subject_prefix");
        let mut o = ok.clone();
        o.stream_reserve_bytes = o.stream_max_bytes;
        assert_eq!(field(o), "stream_reserve_bytes");
        let mut o = ok.clone();
        o.tenant_bucket_max_bytes = 0;
        assert_eq!(field(o), "tenant_bucket_max_bytes");
        let mut o = ok.clone();
        o.replicas = 2;
        assert_eq!(field(o), "replicas");
        let mut o = ok.clone();
        o.max_message_bytes = Some(10);
        assert_eq!(field(o), "max_message_bytes");
        let mut o = ok;
        o.limits.max_record_bytes = 1;
        assert_eq!(field(o), "limits");
    }

    #[test]
    fn a_password_or_token_over_plaintext_nats_is_named_and_tls_clears_it() {
        let mut o = NatsOptions::new(
            vec!["nats://a:4222".into(), "tls://b:4222".into()],
            JournalLimits::default(),
        );
        assert!(o.plaintext_secret_servers().is_empty(), "no secret to send");
        o.auth = NatsAuth::UserPassword {
            user: "iop".into(),
            password: "secret".into(),
        };
        assert_eq!(o.plaintext_secret_servers(), ["nats://a:4222"]);
        o.auth = NatsAuth::Token("t".into());
        assert_eq!(o.plaintext_secret_servers(), ["nats://a:4222"]);
        o.auth = NatsAuth::CredentialsFile("user.creds".into());
        assert!(o.plaintext_secret_servers().is_empty(), "a signed nonce");
        o.auth = NatsAuth::Token("t".into());
        o.tls_client_cert = Some(("c.pem".into(), "k.pem".into()));
        assert!(o.plaintext_secret_servers().is_empty(), "TLS required");
        o.tls_client_cert = None;
        o.tls_ca_file = Some("ca.pem".into());
        assert!(o.plaintext_secret_servers().is_empty(), "TLS required");
    }
}
