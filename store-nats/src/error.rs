//! Errors: [`ConnectError`] at start, and how server answers become the
//! journal's [`JournalError`].

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use iop_core::journal::JournalError;

/// Why [`NatsStore::connect`](crate::NatsStore::connect) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// An option is invalid (the operator's to fix).
    #[error("invalid option {field}: {reason}")]
    Options {
        /// The option.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The credentials file could not be read.
    #[error("reading the credentials file {path}: {source}")]
    Credentials {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The server could not be reached or refused the connection.
    #[error("connecting to {servers}: {source}")]
    Connect {
        /// The servers tried.
        servers: String,
        /// Why.
        source: async_nats::ConnectError,
    },
    /// JetStream answered with an error, or not in time.
    #[error("JetStream: {0}")]
    JetStream(String),
    /// A stream or bucket exists with a configuration the store cannot
    /// work with; the operator changes it or names another.
    #[error("{what} exists with {field} = {found}, the store needs {expected}")]
    Incompatible {
        /// `stream NAME` or `bucket NAME`.
        what: String,
        /// The configuration field.
        field: &'static str,
        /// What the server has.
        found: String,
        /// What the store needs.
        expected: String,
    },
    /// The server would not make a stream or bucket: it cannot reserve
    /// the `max_bytes` asked for. JetStream reserves every file stream's
    /// `max_bytes` when it is made, against the server's
    /// `max_file_store` (by default three quarters of the disk free when
    /// it started) and the account's limit.
    #[error(
        "{what}: the server cannot reserve max_bytes = {max_bytes} ({detail}); \
         raise the server's jetstream max_file_store (or the account's limit), \
         or lower {field}"
    )]
    Reserve {
        /// `stream NAME` or `bucket NAME`.
        what: String,
        /// What it asked for.
        max_bytes: u64,
        /// The option it comes from, and its default.
        field: &'static str,
        /// The server's answer.
        detail: String,
    },
    /// The bucket's records could not be loaded in time.
    #[error("loading the bucket's records: {0}")]
    Load(String),
}

/// What a write's answer means to an operation.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The expected revision or last subject sequence did not hold: read
    /// again and decide again.
    Conflict,
    /// A limit of the stream or bucket refused it (R-JRN-5).
    Full,
    /// Anything else; the outcome of a write may be unknown.
    Store(String),
}

impl From<Failure> for JournalError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Conflict => JournalError::Store("too much contention on the record".into()),
            Failure::Full => JournalError::Full,
            Failure::Store(s) => JournalError::Store(s),
        }
    }
}

/// The JetStream error inside a publish error, if the server sent one.
fn jetstream_error(err: &PublishError) -> Option<&async_nats::jetstream::Error> {
    std::error::Error::source(err)?.downcast_ref::<async_nats::jetstream::Error>()
}

/// Is this server error a limit (bytes, messages, storage) refusing the
/// write? A stream with discard `new` answers "maximum bytes exceeded"
/// (as a store failure) when full; the account or server answer with
/// resource errors.
pub(crate) fn is_full(err: &async_nats::jetstream::Error) -> bool {
    let code = err.error_code();
    code == ErrorCode::ACCOUNT_RESOURCES_EXCEEDED
        || code == ErrorCode::INSUFFICIENT_RESOURCES
        || code == ErrorCode::STORAGE_RESOURCES_EXCEEDED
        || code == ErrorCode::MEMORY_RESOURCES_EXCEEDED
        || (code == ErrorCode::STREAM_STORE_FAILED && {
            let text = err.to_string();
            text.contains("maximum bytes") || text.contains("maximum messages")
        })
}

/// Map a publish's failure.
pub(crate) fn publish_failure(what: &str, err: PublishError) -> Failure {
    match err.kind() {
        PublishErrorKind::WrongLastSequence => Failure::Conflict,
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => Failure::Store(format!(
            "{what}: {err} (the write may or may not have happened)"
        )),
        _ => match jetstream_error(&err) {
            Some(js) if is_full(js) => Failure::Full,
            _ => Failure::Store(format!("{what}: {err}")),
        },
    }
}

/// A read's or request's failure as the journal's error.
pub(crate) fn store_error(what: &str, err: impl std::fmt::Display) -> JournalError {
    JournalError::Store(format!("{what}: {err}"))
}
