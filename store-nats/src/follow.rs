//! Bucket watches: one ordered consumer per followed bucket, feeding a
//! local view with every value any Edge writes: the journal's
//! [`Directory`] (every record), and the tenants' key book
//! ([`crate::tenant`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{
    self,
    consumer::{DeliverPolicy, ReplayPolicy, push},
    stream::Stream,
};
use futures::StreamExt;

use crate::ConnectError;
use crate::directory::{Directory, Marker};
use crate::layout::{LEASE_KEY_PREFIX, Names, RECORD_KEY_PREFIX, RecordValue};

const KV_OPERATION: &str = "KV-Operation";

/// Is this bucket message a delete (or purge) marker?
pub(crate) fn is_marker(headers: Option<&async_nats::HeaderMap>) -> bool {
    headers
        .and_then(|h| h.get(KV_OPERATION))
        .is_some_and(|v| matches!(v.as_str(), "DEL" | "PURGE"))
}

pub(crate) fn lock(dir: &Mutex<Directory>) -> std::sync::MutexGuard<'_, Directory> {
    // Every change of the directory is a single insert or remove: a panic
    // while it was held leaves it consistent.
    dir.lock().unwrap_or_else(|e| e.into_inner())
}

/// A local view a bucket watch feeds.
pub(crate) trait Follower: Send + Sync + 'static {
    /// Apply one bucket message (a value or a delete marker).
    fn apply(&self, message: &jetstream::Message);
    /// The last revision applied: a watch started again starts after it.
    fn followed_revision(&self) -> u64;
}

/// The journal's directory, fed by the watch of the journal's bucket.
pub(crate) struct DirectoryFollower {
    pub(crate) dir: Arc<Mutex<Directory>>,
    pub(crate) names: Names,
}

impl Follower for DirectoryFollower {
    fn apply(&self, message: &jetstream::Message) {
        apply(&self.dir, &self.names, message);
    }

    fn followed_revision(&self) -> u64 {
        lock(&self.dir).followed_revision()
    }
}

/// What a watch follows: the subjects of its bucket, and its consumer's
/// description (for operators).
#[derive(Debug, Clone)]
pub(crate) struct Watch {
    pub(crate) filter_subject: String,
    pub(crate) description: &'static str,
}

/// Apply one bucket message to the directory.
fn apply(dir: &Mutex<Directory>, names: &Names, message: &jetstream::Message) {
    let info = match message.info() {
        Ok(info) => info,
        Err(e) => {
            tracing::warn!(error = %e, "bucket watch: a message without metadata");
            return;
        }
    };
    let revision = info.stream_sequence;
    let written_unix_ms =
        u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
    let marker = is_marker(message.headers.as_ref());
    let mut d = lock(dir);
    if let Some(key) = message.subject.as_str().strip_prefix(&names.kv_prefix) {
        if let Some(tok) = key.strip_prefix(RECORD_KEY_PREFIX) {
            if marker {
                d.delete(tok, revision);
            } else {
                match RecordValue::decode(&message.payload) {
                    Ok(value) => d.put(tok, revision, &value),
                    // R-JRN-6: quarantined, counted, never fatal; logged
                    // without its id (R-OBS-1).
                    Err(e) => {
                        if d.quarantine(tok, revision) {
                            tracing::warn!(
                                event = "journal_record_quarantined",
                                revision,
                                error = %e,
                                "a record in the bucket does not decode: it is skipped"
                            );
                        }
                    }
                }
            }
        }
        if key.starts_with(LEASE_KEY_PREFIX) {
            if marker {
                d.lease_key_deleted(key, revision);
            } else {
                d.lease_key(key, revision);
            }
        }
        if marker {
            d.marker(Marker {
                key: key.to_owned(),
                revision,
                written_unix_ms,
            });
        }
    }
    d.followed(revision);
}

pub(crate) async fn consumer(
    kv: &Stream,
    client: &async_nats::Client,
    watch: &Watch,
    deliver_policy: DeliverPolicy,
) -> Result<(u64, push::Ordered), String> {
    let consumer = kv
        .create_consumer(push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            description: Some(watch.description.into()),
            filter_subject: watch.filter_subject.clone(),
            replay_policy: ReplayPolicy::Instant,
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let pending = consumer.cached_info().num_pending;
    let messages = consumer.messages().await.map_err(|e| e.to_string())?;
    Ok((pending, messages))
}

/// Load every value of the bucket into `follower`, then follow the bucket
/// in a task (aborted when its store is dropped). The load takes as long
/// as the bucket needs, however many records it holds; it fails only when
/// no message comes for `stall` (R-JRN-6: a large journal is no reason to
/// refuse the store).
pub(crate) async fn start<F: Follower>(
    kv: Stream,
    client: async_nats::Client,
    watch: Watch,
    follower: Arc<F>,
    stall: Duration,
) -> Result<tokio::task::JoinHandle<()>, ConnectError> {
    let stalled = || ConnectError::Load(format!("no progress within {stall:?}"));
    let load = async {
        // Done at the last message the bucket held when the load began, or
        // when nothing is pending: while other Edges keep writing, the
        // consumer's pending count may not fall to zero for a long time.
        let last = tokio::time::timeout(stall, kv.get_info())
            .await
            .map_err(|_| stalled())?
            .map_err(|e| ConnectError::Load(e.to_string()))?
            .state
            .last_sequence;
        let (mut pending, mut messages) = tokio::time::timeout(
            stall,
            consumer(&kv, &client, &watch, DeliverPolicy::LastPerSubject),
        )
        .await
        .map_err(|_| stalled())?
        .map_err(ConnectError::Load)?;
        while pending > 0 {
            let next = tokio::time::timeout(stall, messages.next())
                .await
                .map_err(|_| stalled())?;
            match next {
                Some(Ok(message)) => {
                    pending = match message.info() {
                        Ok(i) if i.stream_sequence >= last => 0,
                        Ok(i) => i.pending,
                        Err(_) => 0,
                    };
                    follower.apply(&message);
                }
                Some(Err(e)) => return Err(ConnectError::Load(e.to_string())),
                None => return Err(ConnectError::Load("the watch ended".to_string())),
            }
        }
        Ok(messages)
    };
    let messages = load.await?;
    Ok(tokio::spawn(follow(kv, client, watch, follower, messages)))
}

async fn follow<F: Follower>(
    kv: Stream,
    client: async_nats::Client,
    watch: Watch,
    follower: Arc<F>,
    mut messages: push::Ordered,
) {
    // Bounded pause between attempts to start the watch again.
    const RETRY: Duration = Duration::from_secs(1);
    loop {
        match messages.next().await {
            Some(Ok(message)) => follower.apply(&message),
            // The ordered consumer starts itself again after a lost
            // connection; what it says meanwhile is only logged.
            Some(Err(e)) => tracing::warn!(error = %e, "bucket watch"),
            None => loop {
                let from = follower.followed_revision() + 1;
                match consumer(
                    &kv,
                    &client,
                    &watch,
                    DeliverPolicy::ByStartSequence {
                        start_sequence: from,
                    },
                )
                .await
                {
                    Ok((_, m)) => {
                        messages = m;
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "bucket watch: starting again");
                        tokio::time::sleep(RETRY).await;
                    }
                }
            },
        }
    }
}
