//! `[journal]` and `[journal.nats]`: which store keeps durable responses
//! (SPEC §6), its bounds, and the lease and takeover timings of the Edges
//! that share it (R-TAKE-1, R-MULTI-1).

use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_transport::environment::Environment;
use iop_transport::settings::{ConfigError, field_err};
use serde::Deserialize;

/// Which store keeps the journal of durable responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum JournalStoreKind {
    /// An embedded ACID store in one file under `state_dir` (the default:
    /// no server to run; survives a crash and a restart).
    #[default]
    Embedded,
    /// Process memory: lost at a restart. For tests and throwaway
    /// deployments only.
    Memory,
    /// NATS JetStream (`[journal.nats]`): one store shared by many Edges,
    /// so a client may resume on any Edge and any Edge takes over a dead
    /// one's responses (R-MULTI-1).
    Nats,
}

impl JournalStoreKind {
    /// The stable lower-case name (as configured).
    pub fn as_str(self) -> &'static str {
        match self {
            JournalStoreKind::Embedded => "embedded",
            JournalStoreKind::Memory => "memory",
            JournalStoreKind::Nats => "nats",
        }
    }

    /// Do other Edges open this store too?
    pub fn is_shared(self) -> bool {
        matches!(self, JournalStoreKind::Nats)
    }
}

/// `[journal.nats]`: the NATS JetStream store (`[journal] store =
/// "nats"`). Secrets never sit in the file: a password or token comes
/// from the environment variable named here, credentials from a file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSection {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`), any of the
    /// cluster's; the client fails over between them.
    pub servers: Vec<String>,
    /// A NATS credentials file (user JWT and NKey seed).
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// A user name, with `password_env`.
    #[serde(default)]
    pub user: Option<String>,
    /// The environment variable holding `user`'s password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// The environment variable holding a token.
    #[serde(default)]
    pub token_env: Option<String>,
    /// A PEM file of CA certificates to trust; TLS is then required.
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// A client certificate (PEM) presented to a server that verifies its
    /// clients (mutual TLS), with `tls_key_file`; TLS is then required.
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM; a secret file: mode
    /// 0600, or 0640/0440 owned by root).
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// The stream of events and requests (created if missing).
    #[serde(default = "default_nats_stream")]
    pub stream: String,
    /// The key-value bucket of records, epochs, idempotency keys and
    /// ownership leases (created if missing).
    #[serde(default = "default_nats_bucket")]
    pub bucket: String,
    /// The stream's subjects: `<subject_prefix>.ev.<id>`, `.req.<id>`.
    #[serde(default = "default_nats_subject_prefix")]
    pub subject_prefix: String,
    /// Replicas of the stream and the bucket: 1, or 3 or 5 on a cluster.
    #[serde(default = "default_nats_replicas")]
    pub replicas: usize,
    /// The stream's byte limit (default four times `journal.max_bytes`).
    #[serde(default)]
    pub stream_max_bytes: Option<u64>,
    /// Room kept free in the stream for accepted records (default twice
    /// `journal.max_bytes`).
    #[serde(default)]
    pub stream_reserve_bytes: Option<u64>,
    /// The bucket's byte limit (default twice `journal.max_bytes`).
    #[serde(default)]
    pub bucket_max_bytes: Option<u64>,
    /// Room kept free in the bucket (default `journal.max_bytes`).
    #[serde(default)]
    pub bucket_reserve_bytes: Option<u64>,
    /// The byte limit of each of the tenants' four buckets (counters,
    /// budgets, usage, keys; SPEC §9), default 256 MiB. The server reserves
    /// it when the bucket is made.
    #[serde(default)]
    pub tenant_bucket_max_bytes: Option<u64>,
    /// How long the Edge waits at start to connect and load the bucket.
    #[serde(default = "default_nats_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How long one server answer (an ack, a read) may take.
    #[serde(default = "default_nats_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// The largest message written (default: what the server allows).
    #[serde(default)]
    pub max_message_bytes: Option<usize>,
}

fn default_nats_stream() -> String {
    "IOP_JOURNAL".into()
}
fn default_nats_bucket() -> String {
    "iop_journal".into()
}
fn default_nats_subject_prefix() -> String {
    "iop.journal".into()
}
fn default_nats_replicas() -> usize {
    1
}
fn default_nats_connect_timeout_ms() -> u64 {
    10_000
}
fn default_nats_request_timeout_ms() -> u64 {
    5_000
}

impl NatsSection {
    /// The store's options: the secrets read from the process environment,
    /// paths resolved against `base`. The error names the field.
    pub fn options(
        &self,
        limits: iop_core::journal::JournalLimits,
        base: &Path,
    ) -> Result<iop_store_nats::NatsOptions, ConfigError> {
        self.options_in(limits, base, &Environment::from_process())
    }

    /// [`NatsSection::options`] with the secrets read from `env`.
    pub fn options_in(
        &self,
        limits: iop_core::journal::JournalLimits,
        base: &Path,
        env: &Environment,
    ) -> Result<iop_store_nats::NatsOptions, ConfigError> {
        use iop_store_nats::NatsAuth;
        let f = |name: &str| format!("journal.nats.{name}");
        let secret = |field: &str, var: &str| -> Result<String, ConfigError> {
            match env.var(var) {
                Some(v) if !v.trim().is_empty() => Ok(v.trim().to_owned()),
                _ => Err(field_err(
                    f(field),
                    format!("environment variable `{var}` is not set"),
                )),
            }
        };
        let resolve = |p: &Path| {
            if p.is_relative() {
                base.join(p)
            } else {
                p.to_path_buf()
            }
        };
        let ways = [
            self.credentials_file.is_some(),
            self.user.is_some() || self.password_env.is_some(),
            self.token_env.is_some(),
        ];
        if ways.iter().filter(|w| **w).count() > 1 {
            return Err(field_err(
                f("credentials_file"),
                "give one of credentials_file, user with password_env, token_env",
            ));
        }
        let auth = match (
            &self.credentials_file,
            &self.user,
            &self.password_env,
            &self.token_env,
        ) {
            (Some(path), ..) => NatsAuth::CredentialsFile(resolve(path)),
            (None, Some(user), Some(var), None) => NatsAuth::UserPassword {
                user: user.clone(),
                password: secret("password_env", var)?,
            },
            (None, Some(_), None, None) => {
                return Err(field_err(f("password_env"), "required with user"));
            }
            (None, None, Some(_), None) => {
                return Err(field_err(f("user"), "required with password_env"));
            }
            (None, None, None, Some(var)) => NatsAuth::Token(secret("token_env", var)?),
            _ => NatsAuth::None,
        };
        // A credentials file holds an NKey seed, a client key is a key:
        // held to the rule of every secret file the Edge reads.
        if let NatsAuth::CredentialsFile(path) = &auth {
            check_secret_file(&f("credentials_file"), path)?;
        }
        let tls_client_cert = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => {
                let key = resolve(key);
                check_secret_file(&f("tls_key_file"), &key)?;
                Some((resolve(cert), key))
            }
            (None, None) => None,
            (Some(_), None) => {
                return Err(field_err(f("tls_key_file"), "required with tls_cert_file"));
            }
            (None, Some(_)) => {
                return Err(field_err(f("tls_cert_file"), "required with tls_key_file"));
            }
        };
        for (field, ms) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
        ] {
            if !(100..=600_000).contains(&ms) {
                return Err(field_err(f(field), "must be between 100 and 600000"));
            }
        }
        // Secrets never sit in the file, nor in a URL (it is logged).
        if self.servers.iter().any(|s| s.contains('@')) {
            return Err(field_err(
                f("servers"),
                "a URL must not carry credentials: use credentials_file, user with \
                 password_env, or token_env",
            ));
        }
        let mut o = iop_store_nats::NatsOptions::new(self.servers.clone(), limits);
        o.auth = auth;
        o.tls_ca_file = self.tls_ca_file.as_deref().map(resolve);
        o.tls_client_cert = tls_client_cert;
        o.stream.clone_from(&self.stream);
        o.bucket.clone_from(&self.bucket);
        o.subject_prefix.clone_from(&self.subject_prefix);
        o.replicas = self.replicas;
        if let Some(n) = self.stream_max_bytes {
            o.stream_max_bytes = n;
        }
        if let Some(n) = self.stream_reserve_bytes {
            o.stream_reserve_bytes = n;
        }
        if let Some(n) = self.bucket_max_bytes {
            o.bucket_max_bytes = n;
        }
        if let Some(n) = self.bucket_reserve_bytes {
            o.bucket_reserve_bytes = n;
        }
        if let Some(n) = self.tenant_bucket_max_bytes {
            if n < 1 << 20 {
                return Err(field_err(
                    f("tenant_bucket_max_bytes"),
                    "must be at least 1048576",
                ));
            }
            o.tenant_bucket_max_bytes = n;
        }
        o.connect_timeout = Duration::from_millis(self.connect_timeout_ms);
        o.request_timeout = Duration::from_millis(self.request_timeout_ms);
        o.max_message_bytes = self.max_message_bytes;
        match o.validate() {
            Ok(()) => Ok(o),
            Err(iop_store_nats::ConnectError::Options { field, reason }) => {
                let field = match field {
                    "limits" => "journal.max_bytes".to_owned(),
                    "connect_timeout" => f("connect_timeout_ms"),
                    "request_timeout" => f("request_timeout_ms"),
                    other => f(other),
                };
                Err(field_err(field, reason))
            }
            Err(other) => Err(field_err(f("servers"), other.to_string())),
        }
    }
}

/// A secret file (`field`) readable by others, or by its group unless
/// root owns it, is refused, as every secret file the Edge reads is
/// ([`iop_transport::insecure_provided_secret_mode`]).
fn check_secret_file(field: &str, path: &Path) -> Result<(), ConfigError> {
    let unreadable = |e: std::io::Error| {
        field_err(
            field.to_owned(),
            format!("cannot read {}: {}", path.display(), e.kind()),
        )
    };
    if let Some(mode) = iop_transport::insecure_provided_secret_mode(path).map_err(unreadable)? {
        return Err(field_err(
            field.to_owned(),
            format!(
                "{} has mode {mode:o}: a secret file must not be readable by others, \
                 nor by its group unless root owns it (chmod 600)",
                path.display()
            ),
        ));
    }
    Ok(())
}

/// `[journal]`: durable responses (SPEC §6): stored and background
/// Responses, stored chat completions, `Idempotency-Key` requests.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalSection {
    /// The store.
    #[serde(default)]
    pub store: JournalStoreKind,
    /// The embedded store's file (default `<state_dir>/journal.redb`;
    /// relative paths resolve against the config file's directory).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Whether a Responses request that does not send `store` is stored
    /// (OpenAI's default is `true`).
    #[serde(default = "yes")]
    pub responses_store_default: bool,
    /// How long a finished response is kept, and its `Idempotency-Key`
    /// holds.
    #[serde(default = "default_journal_retention_ms")]
    pub retention_ms: u64,
    /// The store's bound in bytes: past it new durable requests get 503
    /// (accepted ones still finish, R-JRN-5).
    #[serde(default = "default_journal_max_bytes")]
    pub max_bytes: u64,
    /// The most bytes one response (its request and events) may hold.
    #[serde(default = "default_journal_max_record_bytes")]
    pub max_record_bytes: u64,
    /// How often expired responses are removed.
    #[serde(default = "default_journal_sweep_interval_ms")]
    pub sweep_interval_ms: u64,
    /// How long a node keeps a durable run going after losing its Edge
    /// connection, for an Edge to adopt it (R-PARK-1); after an Edge
    /// restart, records not adopted within it (plus a few seconds) end
    /// `incomplete`.
    #[serde(default = "default_park_grace_ms")]
    pub park_grace_ms: u64,
    /// The TTL of this Edge's ownership lease (R-TAKE-1): it is rewritten
    /// every third of it, and another Edge that sees it unchanged for this
    /// long takes this Edge's unfinished responses over (after the park
    /// window).
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
    /// How often unfinished records are scanned for orphans (a previous
    /// run's, a dead Edge's).
    #[serde(default = "default_takeover_scan_interval_ms")]
    pub takeover_scan_interval_ms: u64,
    /// How long a running response's journal write the store failed (a
    /// failed commit, a full write queue, a NATS server restarting) is
    /// tried again before the response fails (R-JRN-6); 0: never.
    #[serde(default = "default_write_retry_ms")]
    pub write_retry_ms: u64,
    /// The embedded store's writer queue: operations waiting for the
    /// writer at most; one more is refused (and tried again within
    /// `write_retry_ms`, R-JRN-6). A deployment with few writers, or a
    /// test of the shares below, sets it smaller (R-LIM-4).
    #[serde(default = "default_writer_queue")]
    pub writer_queue: usize,
    /// Of those, the operations of one principal waiting at most, so one
    /// tenant's burst leaves room for the others (R-TEN-1); defaults to a
    /// quarter of `writer_queue`.
    #[serde(default)]
    pub writer_queue_per_principal: Option<usize>,
    /// Requests reading stored responses at once (retrieves,
    /// `input_items`, cancels and deletes, `previous_response_id`
    /// conversations), across every principal; the last
    /// `reads_in_flight_per_principal` places are kept for principals
    /// reading nothing (R-LIM-6). Past a bound: 503 `server_busy`.
    #[serde(default = "default_reads_in_flight")]
    pub reads_in_flight: usize,
    /// Of those, one principal's (all its keys).
    #[serde(default = "default_reads_in_flight_per_principal")]
    pub reads_in_flight_per_principal: usize,
    /// Of those, one key's; defaults to the principal's.
    #[serde(default)]
    pub reads_in_flight_per_key: Option<usize>,
    /// `[journal.nats]`, with `store = "nats"`.
    #[serde(default)]
    pub nats: Option<NatsSection>,
}

fn default_lease_ttl_ms() -> u64 {
    15_000
}

fn default_takeover_scan_interval_ms() -> u64 {
    5_000
}

fn default_write_retry_ms() -> u64 {
    iop_core::time::duration_ms(iop_core::edge::durable::WRITE_RETRY.deadline)
}

fn default_writer_queue() -> usize {
    iop_store::EmbeddedOptions::default().max_queued_ops
}

/// The largest `journal.writer_queue`.
pub(super) const MAX_WRITER_QUEUE: usize = 1 << 20;

fn default_reads_in_flight() -> usize {
    iop_core::edge::store_reads::ReadLimits::default().total
}

fn default_reads_in_flight_per_principal() -> usize {
    iop_core::edge::store_reads::ReadLimits::default().per_principal
}

fn default_park_grace_ms() -> u64 {
    iop_wire::DEFAULT_PARK_GRACE_MS
}

impl Default for JournalSection {
    fn default() -> Self {
        JournalSection {
            store: JournalStoreKind::default(),
            path: None,
            responses_store_default: true,
            retention_ms: default_journal_retention_ms(),
            max_bytes: default_journal_max_bytes(),
            max_record_bytes: default_journal_max_record_bytes(),
            sweep_interval_ms: default_journal_sweep_interval_ms(),
            park_grace_ms: default_park_grace_ms(),
            lease_ttl_ms: default_lease_ttl_ms(),
            takeover_scan_interval_ms: default_takeover_scan_interval_ms(),
            write_retry_ms: default_write_retry_ms(),
            writer_queue: default_writer_queue(),
            writer_queue_per_principal: None,
            reads_in_flight: default_reads_in_flight(),
            reads_in_flight_per_principal: default_reads_in_flight_per_principal(),
            reads_in_flight_per_key: None,
            nats: None,
        }
    }
}

fn default_journal_retention_ms() -> u64 {
    iop_core::journal::JournalLimits::default().retention_ms
}

fn default_journal_max_bytes() -> u64 {
    iop_core::journal::JournalLimits::default().max_bytes
}

fn default_journal_max_record_bytes() -> u64 {
    iop_core::journal::JournalLimits::default().max_record_bytes
}

fn default_journal_sweep_interval_ms() -> u64 {
    60_000
}

impl JournalSection {
    /// The journal's limits (validated against core's rules at load).
    pub fn limits(&self) -> iop_core::journal::JournalLimits {
        iop_core::journal::JournalLimits {
            retention_ms: self.retention_ms,
            max_bytes: self.max_bytes,
            max_record_bytes: self.max_record_bytes,
        }
    }

    /// The embedded store's file.
    pub fn file(&self, state_dir: &Path) -> PathBuf {
        self.path
            .clone()
            .unwrap_or_else(|| state_dir.join("journal.redb"))
    }

    /// How a run's journal write the store failed is tried again
    /// (R-JRN-6): core's policy within `write_retry_ms`.
    pub fn write_retry(&self) -> iop_core::edge::durable::WriteRetryPolicy {
        let policy = iop_core::edge::durable::WRITE_RETRY;
        iop_core::edge::durable::WriteRetryPolicy {
            deadline: Duration::from_millis(self.write_retry_ms),
            max_attempts: if self.write_retry_ms == 0 {
                1
            } else {
                policy.max_attempts
            },
            ..policy
        }
    }

    /// The embedded store's writer queue share of one principal
    /// (`writer_queue_per_principal`, else a quarter of the queue).
    pub fn writer_queue_per_principal(&self) -> usize {
        self.writer_queue_per_principal
            .unwrap_or((self.writer_queue / 4).max(1))
    }

    /// The embedded store's writer bounds: its queue and one principal's
    /// share of it.
    pub fn embedded_options(&self) -> iop_store::EmbeddedOptions {
        iop_store::EmbeddedOptions {
            max_queued_ops: self.writer_queue,
            max_queued_ops_per_principal: self.writer_queue_per_principal(),
            ..iop_store::EmbeddedOptions::default()
        }
    }

    /// The bounds on requests reading stored responses (R-LIM-6).
    pub fn read_limits(&self) -> iop_core::edge::store_reads::ReadLimits {
        iop_core::edge::store_reads::ReadLimits {
            total: self.reads_in_flight,
            per_principal: self.reads_in_flight_per_principal,
            per_key: self
                .reads_in_flight_per_key
                .unwrap_or(self.reads_in_flight_per_principal),
        }
    }

    /// How long an orphan waits for its node to report its run parked
    /// (R-PARK-2) before it ends `incomplete` (R-TAKE-1): the park grace
    /// and the slack for the reports.
    pub fn park_window(&self) -> Duration {
        Duration::from_millis(self.park_grace_ms) + iop_core::edge::request::PARK_REPORT_SLACK
    }

    pub(super) fn validate(&mut self, base: &Path, env: &Environment) -> Result<(), ConfigError> {
        use iop_core::journal::JournalLimitsError;
        if let Err(e) = self.limits().validate() {
            let field = match e {
                JournalLimitsError::Retention(_) => "journal.retention_ms",
                JournalLimitsError::MaxBytes { .. } => "journal.max_bytes",
                JournalLimitsError::MaxRecordBytes(_) => "journal.max_record_bytes",
            };
            return Err(field_err(field, e.to_string()));
        }
        if !(1000..=3_600_000).contains(&self.sweep_interval_ms) {
            return Err(field_err(
                "journal.sweep_interval_ms",
                "must be between 1000 and 3600000",
            ));
        }
        if !(100..=600_000).contains(&self.park_grace_ms) {
            return Err(field_err(
                "journal.park_grace_ms",
                "must be between 100 and 600000",
            ));
        }
        if let Some(path) = &mut self.path {
            if path.as_os_str().is_empty() {
                return Err(field_err("journal.path", "must not be empty"));
            }
            if path.is_relative() {
                *path = base.join(&*path);
            }
        }
        if !(iop_core::journal::MIN_LEASE_TTL_MS..=iop_core::journal::MAX_LEASE_TTL_MS)
            .contains(&self.lease_ttl_ms)
        {
            return Err(field_err(
                "journal.lease_ttl_ms",
                format!(
                    "must be between {} and {}",
                    iop_core::journal::MIN_LEASE_TTL_MS,
                    iop_core::journal::MAX_LEASE_TTL_MS
                ),
            ));
        }
        if self.write_retry_ms > 600_000 {
            return Err(field_err(
                "journal.write_retry_ms",
                "must be at most 600000",
            ));
        }
        if !(1..=MAX_WRITER_QUEUE).contains(&self.writer_queue) {
            return Err(field_err(
                "journal.writer_queue",
                format!("must be between 1 and {MAX_WRITER_QUEUE}"),
            ));
        }
        let queue = self.writer_queue;
        if !(1..=queue).contains(&self.writer_queue_per_principal()) {
            return Err(field_err(
                "journal.writer_queue_per_principal",
                format!("must be between 1 and journal.writer_queue ({queue})"),
            ));
        }
        if let Err(e) = self.read_limits().validate() {
            use iop_core::edge::store_reads::ReadLimitsError;
            let field = match e {
                ReadLimitsError::Total => "journal.reads_in_flight",
                ReadLimitsError::PerKey(_) => "journal.reads_in_flight_per_key",
                _ => "journal.reads_in_flight_per_principal",
            };
            return Err(field_err(field, e.to_string()));
        }
        if !(100..=600_000).contains(&self.takeover_scan_interval_ms) {
            return Err(field_err(
                "journal.takeover_scan_interval_ms",
                "must be between 100 and 600000",
            ));
        }
        // R-TAKE-1, R-MULTI-1: a live Edge's lease must be read again well
        // within its TTL, or a lease that moves between two reads would
        // look unchanged for a whole TTL.
        if self.store.is_shared() && self.takeover_scan_interval_ms * 2 > self.lease_ttl_ms {
            return Err(field_err(
                "journal.takeover_scan_interval_ms",
                "must be at most half of journal.lease_ttl_ms with a shared store",
            ));
        }
        let limits = self.limits();
        match (self.store, &mut self.nats) {
            (JournalStoreKind::Nats, None) => {
                return Err(field_err(
                    "journal.nats",
                    "required with store = \"nats\" (at least `servers`)",
                ));
            }
            (JournalStoreKind::Nats, Some(nats)) => {
                // Checked now (secrets read, every option validated), so a
                // bad one is refused at load, by name; used at start.
                nats.options_in(limits, base, env)?;
                for p in [
                    &mut nats.credentials_file,
                    &mut nats.tls_ca_file,
                    &mut nats.tls_cert_file,
                    &mut nats.tls_key_file,
                ]
                .into_iter()
                .flatten()
                {
                    if p.is_relative() {
                        *p = base.join(&*p);
                    }
                }
            }
            (_, Some(_)) => {
                return Err(field_err(
                    "journal.store",
                    "must be \"nats\" when [journal.nats] is given",
                ));
            }
            (_, None) => {}
        }
        Ok(())
    }
}

fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use iop_transport::config_file::ConfigFile as _;
    use std::path::Path;

    use super::*;
    use crate::config::fixture::{BASE, field_of, parse};
    use crate::config::{DEFAULT_EDGE_ID, EdgeConfig};

    #[test]
    fn a_nats_journal_needs_an_edge_id_and_its_section_and_each_bad_field_is_named() {
        // Defaults: one Edge on its own store.
        let c = parse("").unwrap();
        assert_eq!(c.edge.edge_id(), DEFAULT_EDGE_ID);
        assert_eq!(c.journal.store, JournalStoreKind::Embedded);
        assert_eq!(
            (c.journal.lease_ttl_ms, c.journal.takeover_scan_interval_ms),
            (15_000, 5_000)
        );
        let with_id = |id: &str, extra: &str| {
            let text = BASE.replace("[edge]\n", &format!("[edge]\nedge_id = \"{id}\"\n"));
            EdgeConfig::parse(&format!("{text}{extra}"), Path::new("/etc/iop"))
        };
        let nats = "[journal]\nstore = \"nats\"\n[journal.nats]\nservers = [\"nats://10.0.0.1:4222\", \"nats://10.0.0.2:4222\"]\n";
        let e = parse(nats).unwrap_err();
        assert_eq!(field_of(e), "edge.edge_id", "a shared store needs an id");
        let c = with_id("edge-a", nats).unwrap();
        assert_eq!(c.edge.edge_id(), "edge-a");
        let n = c.journal.nats.as_ref().unwrap();
        let o = n
            .options(c.journal.limits(), Path::new("/etc/iop"))
            .unwrap();
        assert_eq!(
            (o.stream.as_str(), o.bucket.as_str(), o.replicas),
            ("IOP_JOURNAL", "iop_journal", 1)
        );
        assert_eq!(o.servers.len(), 2);
        let e = with_id("edge a", nats).unwrap_err();
        assert_eq!(field_of(e), "edge.edge_id");
        let e = with_id("edge-a", "[journal]\nstore = \"nats\"\n").unwrap_err();
        assert_eq!(field_of(e), "journal.nats");
        let e = with_id(
            "edge-a",
            "[journal.nats]\nservers = [\"nats://127.0.0.1:4222\"]\n",
        )
        .unwrap_err();
        assert_eq!(
            field_of(e),
            "journal.store",
            "[journal.nats] without store = nats"
        );
        for (line, field) in [
            ("servers = []", "journal.nats.servers"),
            ("servers = [\"nats://[::1\"]", "journal.nats.servers"),
            (
                "servers = [\"nats://iop:pw@h:4222\"]",
                "journal.nats.servers",
            ),
            (
                "servers = [\"nats://h:4222\"]\nreplicas = 2",
                "journal.nats.replicas",
            ),
            (
                "servers = [\"nats://h:4222\"]\nbucket = \"a.b\"",
                "journal.nats.bucket",
            ),
            (
                "servers = [\"nats://h:4222\"]\nconnect_timeout_ms = 0",
                "journal.nats.connect_timeout_ms",
            ),
            (
                "servers = [\"nats://h:4222\"]\nuser = \"iop\"",
                "journal.nats.password_env",
            ),
            (
                "servers = [\"nats://h:4222\"]\npassword_env = \"IOP_TEST_NATS_PASSWORD_SET\"",
                "journal.nats.user",
            ),
            (
                "servers = [\"nats://h:4222\"]\ntoken_env = \"IOP_TEST_NATS_TOKEN_UNSET\"",
                "journal.nats.token_env",
            ),
            (
                "servers = [\"nats://h:4222\"]\ntoken_env = \"T\"\ncredentials_file = \"c.creds\"",
                "journal.nats.credentials_file",
            ),
            (
                "servers = [\"nats://h:4222\"]\nsurprise = 1",
                "journal.nats.surprise",
            ),
        ] {
            let text = format!("[journal]\nstore = \"nats\"\n[journal.nats]\n{line}\n");
            match with_id("edge-a", &text) {
                Err(e) => assert_eq!(field_of(e), field, "{line}"),
                Ok(_) => panic!("{line} was accepted"),
            }
        }
        let e = with_id(
            "edge-a",
            "[journal]\nstore = \"nats\"\nlease_ttl_ms = 2000\ntakeover_scan_interval_ms = 1500\n\
             [journal.nats]\nservers = [\"nats://127.0.0.1:4222\"]\n",
        )
        .unwrap_err();
        assert_eq!(field_of(e), "journal.takeover_scan_interval_ms");
        for (line, field) in [
            ("lease_ttl_ms = 10", "journal.lease_ttl_ms"),
            (
                "takeover_scan_interval_ms = 0",
                "journal.takeover_scan_interval_ms",
            ),
        ] {
            let e = parse(&format!("[journal]\n{line}\n")).unwrap_err();
            assert_eq!(field_of(e), field);
        }
    }

    #[test]
    fn the_writer_queue_and_the_readers_in_flight_are_bounded_and_validated_r_lim_6_r_ten_1() {
        let c = parse("").unwrap();
        let o = c.journal.embedded_options();
        assert_eq!(
            (o.max_queued_ops, o.max_queued_ops_per_principal),
            (4096, 1024)
        );
        assert_eq!(
            c.journal.read_limits(),
            iop_core::edge::store_reads::ReadLimits::default()
        );
        // A smaller queue, its share a quarter of it unless set.
        let c = parse("[journal]\nwriter_queue = 64\n").unwrap();
        let o = c.journal.embedded_options();
        assert_eq!((o.max_queued_ops, o.max_queued_ops_per_principal), (64, 16));
        let c = parse("[journal]\nwriter_queue = 64\nwriter_queue_per_principal = 64\n").unwrap();
        assert_eq!(
            c.journal.embedded_options().max_queued_ops_per_principal,
            64
        );
        let c =
            parse("[journal]\nreads_in_flight = 16\nreads_in_flight_per_principal = 4\n").unwrap();
        let l = c.journal.read_limits();
        assert_eq!((l.total, l.per_principal, l.per_key), (16, 4, 4));
        for (lines, field) in [
            ("writer_queue = 0", "journal.writer_queue"),
            ("writer_queue = 2000000", "journal.writer_queue"),
            (
                "writer_queue = 64\nwriter_queue_per_principal = 65",
                "journal.writer_queue_per_principal",
            ),
            (
                "writer_queue_per_principal = 0",
                "journal.writer_queue_per_principal",
            ),
            ("reads_in_flight = 100000", "journal.reads_in_flight"),
            (
                "reads_in_flight = 32",
                "journal.reads_in_flight_per_principal",
            ),
            (
                "reads_in_flight_per_principal = 0",
                "journal.reads_in_flight_per_principal",
            ),
            (
                "reads_in_flight_per_key = 33",
                "journal.reads_in_flight_per_key",
            ),
            (
                "reads_in_flight_per_key = 0",
                "journal.reads_in_flight_per_key",
            ),
        ] {
            let e = parse(&format!("[journal]\n{lines}\n")).unwrap_err();
            assert_eq!(field_of(e), field, "{lines}");
        }
    }

    #[test]
    fn nats_secrets_come_from_the_environment_and_paths_resolve_against_the_file() {
        let var = "IOP_NATS_PASSWORD";
        // Padded: the value is trimmed as a file's line is.
        let secret = "nats-password-0123";
        let padded = format!(" {secret} ");
        let env = Environment::from_pairs([(var, padded.as_str())]);
        let text = BASE.replace("[edge]\n", "[edge]\nedge_id = \"edge-b\"\n");
        let c = EdgeConfig::parse_in(
            &format!(
                "{text}[journal]\nstore = \"nats\"\n[journal.nats]\nservers = [\"tls://nats.internal:4222\"]\n\
                 user = \"iop\"\npassword_env = \"{var}\"\ntls_ca_file = \"nats-ca.pem\"\nreplicas = 3\n"
            ),
            Path::new("/etc/iop"),
            &env,
        )
        .unwrap();
        let n = c.journal.nats.as_ref().unwrap();
        assert_eq!(
            n.tls_ca_file.as_deref(),
            Some(Path::new("/etc/iop/nats-ca.pem"))
        );
        let o = n
            .options_in(c.journal.limits(), Path::new("/elsewhere"), &env)
            .unwrap();
        assert_eq!(
            o.auth,
            iop_store_nats::NatsAuth::UserPassword {
                user: "iop".into(),
                password: secret.to_owned()
            }
        );
        assert_eq!(
            o.tls_ca_file.as_deref(),
            Some(Path::new("/etc/iop/nats-ca.pem"))
        );
        assert_eq!(o.replicas, 3);
        assert!(
            !format!("{c:?}").contains(secret),
            "the password is never shown"
        );
        assert!(
            !format!("{o:?}").contains(secret),
            "the password is never shown"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_nats_credentials_file_or_client_key_others_may_read_is_refused_naming_it() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, mode: u32| {
            let path = dir.path().join(name);
            std::fs::write(&path, "secret").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        file("open.creds", 0o644);
        file("closed.creds", 0o600);
        file("client.pem", 0o644);
        file("open.key", 0o644);
        file("closed.key", 0o600);
        let text = BASE.replace("[edge]\n", "[edge]\nedge_id = \"edge-c\"\n");
        let parse = |nats: &str| {
            EdgeConfig::parse(
                &format!(
                    "{text}[journal]\nstore = \"nats\"\n[journal.nats]\nservers = [\"tls://n:4222\"]\n{nats}\n"
                ),
                dir.path(),
            )
        };
        for (lines, field) in [
            (
                "credentials_file = \"open.creds\"",
                "journal.nats.credentials_file",
            ),
            (
                "credentials_file = \"missing.creds\"",
                "journal.nats.credentials_file",
            ),
            (
                "tls_cert_file = \"client.pem\"\ntls_key_file = \"open.key\"",
                "journal.nats.tls_key_file",
            ),
            (
                "tls_cert_file = \"client.pem\"",
                "journal.nats.tls_key_file",
            ),
            (
                "tls_key_file = \"closed.key\"",
                "journal.nats.tls_cert_file",
            ),
        ] {
            match parse(lines) {
                Err(e) => assert_eq!(field_of(e), field, "{lines}"),
                Ok(_) => panic!("{lines} was accepted"),
            }
        }
        let c = parse(
            "credentials_file = \"closed.creds\"\ntls_cert_file = \"client.pem\"\ntls_key_file = \"closed.key\"",
        )
        .unwrap();
        let o = c
            .journal
            .nats
            .as_ref()
            .unwrap()
            .options(c.journal.limits(), dir.path())
            .unwrap();
        assert_eq!(
            o.tls_client_cert,
            Some((dir.path().join("client.pem"), dir.path().join("closed.key")))
        );
        assert!(o.tls_required());
    }
}
