//! Connecting, and making (or checking) the stream and the buckets.

use std::time::Duration;

use async_nats::jetstream::{
    self, ErrorCode,
    context::{CreateStreamErrorKind, GetStreamErrorKind},
    stream::{self, DiscardPolicy, RetentionPolicy, StorageType},
};

use crate::options::{HEADER_ROOM_BYTES, NatsAuth, NatsOptions};
use crate::{ConnectError, layout::Names};

/// Connect the client as the options say.
pub(crate) async fn client(opts: &NatsOptions) -> Result<async_nats::Client, ConnectError> {
    let mut co = async_nats::ConnectOptions::new()
        .name("iop journal")
        .connection_timeout(opts.connect_timeout)
        .request_timeout(Some(opts.request_timeout))
        // Reconnect for ever: a server restart must not end the store; and
        // soon, a tenth of a second more each attempt up to one second, so
        // the writes waiting on a restarted server go through within their
        // retry bound (R-JRN-6), not after the client's own backoff of up
        // to 4 s.
        .max_reconnects(None)
        .reconnect_delay_callback(reconnect_delay);
    co = match &opts.auth {
        NatsAuth::None => co,
        NatsAuth::CredentialsFile(path) => {
            co.credentials_file(path)
                .await
                .map_err(|source| ConnectError::Credentials {
                    path: path.display().to_string(),
                    source,
                })?
        }
        NatsAuth::UserPassword { user, password } => {
            co.user_and_password(user.clone(), password.clone())
        }
        NatsAuth::Token(token) => co.token(token.clone()),
    };
    if let Some(ca) = &opts.tls_ca_file {
        co = co.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let Some((cert, key)) = &opts.tls_client_cert {
        co = co
            .add_client_certificate(cert.clone(), key.clone())
            .require_tls(true);
    }
    let mut addrs = Vec::with_capacity(opts.servers.len());
    for s in &opts.servers {
        addrs.push(
            s.parse::<async_nats::ServerAddr>()
                .map_err(|e| ConnectError::Options {
                    field: "servers",
                    reason: format!("{s}: {e}"),
                })?,
        );
    }
    co.connect(addrs)
        .await
        .map_err(|source| ConnectError::Connect {
            servers: opts.servers.join(","),
            source,
        })
}

/// The delay before reconnect attempt `attempts` (from 1): none for the
/// first, then 100 ms more each, at most [`MAX_RECONNECT_DELAY`].
pub(crate) fn reconnect_delay(attempts: usize) -> Duration {
    let steps = u32::try_from(attempts.saturating_sub(1)).unwrap_or(u32::MAX);
    Duration::from_millis(100)
        .saturating_mul(steps)
        .min(MAX_RECONNECT_DELAY)
}

/// The longest pause between two reconnect attempts.
pub(crate) const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);

/// The largest message body the store writes.
pub(crate) fn max_message_bytes(opts: &NatsOptions, client: &async_nats::Client) -> usize {
    let server = client
        .server_info()
        .max_payload
        .saturating_sub(HEADER_ROOM_BYTES);
    opts.max_message_bytes.map_or(server, |n| n.min(server))
}

fn events_config(opts: &NatsOptions, names: &Names) -> stream::Config {
    stream::Config {
        name: opts.stream.clone(),
        description: Some("iop journal: events and requests of durable responses".into()),
        subjects: names.stream_subjects(),
        retention: RetentionPolicy::Limits,
        max_bytes: i64::try_from(opts.stream_max_bytes).unwrap_or(i64::MAX),
        max_messages: -1,
        max_messages_per_subject: -1,
        max_message_size: -1,
        discard: DiscardPolicy::New,
        storage: StorageType::File,
        num_replicas: opts.replicas,
        allow_direct: true,
        deny_delete: false,
        deny_purge: false,
        ..Default::default()
    }
}

/// What the store needs of a stream's configuration, field by field.
fn check(what: &str, found: &stream::Config, want: &stream::Config) -> Result<(), ConnectError> {
    let incompatible = |field: &'static str, found: String, expected: String| {
        Err(ConnectError::Incompatible {
            what: what.to_owned(),
            field,
            found,
            expected,
        })
    };
    let mut found_subjects = found.subjects.clone();
    let mut want_subjects = want.subjects.clone();
    found_subjects.sort();
    want_subjects.sort();
    if found_subjects != want_subjects {
        return incompatible(
            "subjects",
            format!("{found_subjects:?}"),
            format!("{want_subjects:?}"),
        );
    }
    if found.retention != want.retention {
        return incompatible(
            "retention",
            format!("{:?}", found.retention),
            format!("{:?}", want.retention),
        );
    }
    if found.discard != want.discard {
        return incompatible(
            "discard",
            format!("{:?}", found.discard),
            format!("{:?}", want.discard),
        );
    }
    if found.storage != want.storage {
        return incompatible(
            "storage",
            format!("{:?}", found.storage),
            format!("{:?}", want.storage),
        );
    }
    if found.max_bytes != want.max_bytes {
        return incompatible(
            "max_bytes",
            found.max_bytes.to_string(),
            want.max_bytes.to_string(),
        );
    }
    if found.num_replicas != want.num_replicas {
        return incompatible(
            "num_replicas",
            found.num_replicas.to_string(),
            want.num_replicas.to_string(),
        );
    }
    let unlimited = |n: i64| n <= 0;
    if unlimited(want.max_messages_per_subject) != unlimited(found.max_messages_per_subject)
        || (!unlimited(want.max_messages_per_subject)
            && found.max_messages_per_subject != want.max_messages_per_subject)
    {
        return incompatible(
            "max_messages_per_subject",
            found.max_messages_per_subject.to_string(),
            want.max_messages_per_subject.to_string(),
        );
    }
    if !unlimited(found.max_messages) {
        return incompatible("max_messages", found.max_messages.to_string(), "-1".into());
    }
    if found.max_age != want.max_age {
        return incompatible(
            "max_age",
            format!("{:?}", found.max_age),
            format!("{:?}", want.max_age),
        );
    }
    if !found.allow_direct {
        return incompatible("allow_direct", "false".into(), "true".into());
    }
    if found.deny_purge {
        return incompatible("deny_purge", "true".into(), "false".into());
    }
    if found.deny_delete && !want.deny_delete {
        return incompatible("deny_delete", "true".into(), "false".into());
    }
    if found.mirror.is_some() || found.sources.as_ref().is_some_and(|s| !s.is_empty()) {
        return incompatible("mirror/sources", "set".into(), "none".into());
    }
    Ok(())
}

fn not_found(kind: &GetStreamErrorKind) -> bool {
    matches!(kind, GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// The events stream, created if missing, checked if not.
pub(crate) async fn events_stream(
    js: &jetstream::Context,
    opts: &NatsOptions,
    names: &Names,
) -> Result<stream::Stream, ConnectError> {
    let want = events_config(opts, names);
    let what = format!("stream {}", opts.stream);
    get_or_create(
        js,
        &what,
        want,
        "[journal.nats] stream_max_bytes (by default 4 x [journal] max_bytes)",
    )
    .await
}

/// The stream `want.name`, created as `want` if missing, checked against
/// it if not. `max_bytes_field` names the option its `max_bytes` comes
/// from, for the operator when the server cannot reserve it.
async fn get_or_create(
    js: &jetstream::Context,
    what: &str,
    want: stream::Config,
    max_bytes_field: &'static str,
) -> Result<stream::Stream, ConnectError> {
    let stream = match js.get_stream(&want.name).await {
        Ok(s) => s,
        Err(e) if not_found(&e.kind()) => match js.create_stream(want.clone()).await {
            Ok(s) => s,
            // Another Edge created it meanwhile: check that one.
            Err(create) => match js.get_stream(&want.name).await {
                Ok(s) => s,
                Err(_) => {
                    return Err(match create.kind() {
                        CreateStreamErrorKind::JetStream(e) if cannot_reserve(&e) => {
                            ConnectError::Reserve {
                                what: what.to_owned(),
                                max_bytes: u64::try_from(want.max_bytes).unwrap_or(0),
                                field: max_bytes_field,
                                detail: e.to_string(),
                            }
                        }
                        _ => ConnectError::JetStream(format!("{what}: {create}")),
                    });
                }
            },
        },
        Err(e) => return Err(ConnectError::JetStream(format!("{what}: {e}"))),
    };
    check(what, &stream.cached_info().config, &want)?;
    Ok(stream)
}

/// Did the server refuse a new stream because its `max_bytes` cannot be
/// reserved ("insufficient storage resources available")? JetStream
/// reserves every file stream's `max_bytes` against the server's
/// `max_file_store` and the account's limit when the stream is made,
/// whatever it holds. Other resource errors (an overloaded JetStream API,
/// a cluster that cannot place the stream) are not this, and are
/// reported as the server sent them.
fn cannot_reserve(e: &async_nats::jetstream::Error) -> bool {
    e.error_code() == ErrorCode::STORAGE_RESOURCES_EXCEEDED
}

/// The journal's bucket's stream, the bucket created if missing, checked
/// if not.
pub(crate) async fn bucket_stream(
    js: &jetstream::Context,
    opts: &NatsOptions,
) -> Result<stream::Stream, ConnectError> {
    bucket(
        js,
        opts,
        &Bucket {
            name: opts.bucket.clone(),
            description: "iop journal: records, epochs and idempotency keys",
            max_bytes: opts.bucket_max_bytes,
            max_bytes_field: "[journal.nats] bucket_max_bytes (by default 2 x [journal] max_bytes)",
            max_age: Duration::ZERO,
        },
    )
    .await
}

/// A key-value bucket the store uses.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    /// Its name (its stream is `KV_<name>`).
    pub(crate) name: String,
    pub(crate) description: &'static str,
    /// Its `max_bytes` (discard new: a write past it is refused).
    pub(crate) max_bytes: u64,
    /// The option `max_bytes` comes from.
    pub(crate) max_bytes_field: &'static str,
    /// How long a value stays after its last write (zero: for good).
    pub(crate) max_age: Duration,
}

/// A bucket's stream, the bucket created if missing, checked if not.
///
/// A bucket is a stream `KV_<bucket>` on `$KV.<bucket>.>` keeping one
/// message per subject; it is made here as the stream it is, as the
/// NATS clients make it (the client library's own helper asks for
/// account fields a 2.9 server does not send).
pub(crate) async fn bucket(
    js: &jetstream::Context,
    opts: &NatsOptions,
    bucket: &Bucket,
) -> Result<stream::Stream, ConnectError> {
    let stream_name = format!("KV_{}", bucket.name);
    let what = format!("bucket {}", bucket.name);
    let want = stream::Config {
        name: stream_name,
        description: Some(bucket.description.into()),
        subjects: vec![format!("$KV.{}.>", bucket.name)],
        retention: RetentionPolicy::Limits,
        max_age: bucket.max_age,
        max_bytes: i64::try_from(bucket.max_bytes).unwrap_or(i64::MAX),
        max_messages: -1,
        max_messages_per_subject: 1,
        max_message_size: -1,
        discard: DiscardPolicy::New,
        storage: StorageType::File,
        num_replicas: opts.replicas,
        allow_rollup: true,
        allow_direct: true,
        deny_delete: true,
        deny_purge: false,
        ..Default::default()
    };
    get_or_create(js, &what, want, bucket.max_bytes_field).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnects_come_soon_and_at_most_a_second_apart_r_jrn_6() {
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(100));
        assert_eq!(reconnect_delay(6), Duration::from_millis(500));
        assert_eq!(reconnect_delay(11), MAX_RECONNECT_DELAY);
        assert_eq!(reconnect_delay(usize::MAX), MAX_RECONNECT_DELAY);
    }
}
