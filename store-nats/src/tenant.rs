//! Tenants' shared state on JetStream key-value buckets (SPEC §9): the
//! counters every Edge claims its allowances from (R-TEN-3), usage rows
//! (R-TEN-5) and runtime API keys (R-TEN-4), shared by every Edge of the
//! deployment through the journal store's connection
//! ([`NatsStore::tenant_store`](crate::NatsStore::tenant_store)).
//!
//! ## Buckets
//!
//! Four buckets named after the journal's (`<bucket>_…`), with the
//! journal's replicas and history 1, each of at most
//! `tenant_bucket_max_bytes`:
//!
//! | bucket | key | value | kept |
//! | --- | --- | --- | --- |
//! | `_rates` | `c.<meter>.<window>.<k\|p>.<name>`, a limit per model's `c.<meter>.<window>.<km\|pm>.<name>.<model>` | the counter, claimed, the holders that gave back | `max_age` [`RATE_COUNTER_MAX_AGE`]; a sweep forgets a window once over |
//! | `_budgets` | the same, for spend | the same | until a sweep finds its period over; a budget in total for good |
//! | `_usage` | `u.<day>.<principal>.<key>.<model>` | the row's key and totals | `max_age` of the retention ([`USAGE_RETENTION_DAYS`]) |
//! | `_keys` | `k.<id>` | the [`KeyRecord`], its format byte first (1 as every earlier build; 2 with limits per model: `iop_core::tenant::key_format`) | for good (a revoked key is kept) |
//!
//! Every name is escaped into one subject token as the journal's ids are
//! (a name too long for a subject is replaced by its hash), so no name
//! reaches another's key. Values start with a format byte; a counter's
//! and a row's value carry their whole key, so a listing reads them back
//! without parsing subjects. The server is a 2.9 (no per-message TTL, no
//! counters): expiry is the buckets' `max_age`, counting from a value's
//! last write, which is never earlier than the end of what it counts
//! would allow.
//!
//! ## Compare-and-set
//!
//! A claim reads its counter with its revision, decides with
//! [`check_claim`] on the value as stored, and writes the new total with
//! a compare-and-set on that revision (the bucket's expected last subject
//! sequence). A lost race reads again (from the stream's leader, as a
//! replica's direct read may lag) after a short random pause, and decides
//! again, at most [`MAX_CAS_ATTEMPTS`] times; then the claim fails
//! [`TenantStoreError::Unavailable`] and the Edge falls back as for an
//! outage. A claim that finds the window exhausted writes nothing. A
//! stopping Edge's give-back is decided the same way, by
//! [`check_give_back`] on the counter as stored: the decrement and the
//! record of its holder are one value written by one compare-and-set, so a
//! give-back sent again after its answer was lost frees nothing more. (An
//! Edge of an earlier build reads such a counter's total, but its claims
//! write the total alone, dropping the record: upgrade every Edge before
//! relying on it.) A usage
//! row is added the same way, row by row (a few at once); the rows not
//! added come back to the caller. A key is written over the revision its
//! writer read: another revision is [`TenantStoreError::Conflict`]
//! naming the stored one.
//!
//! ## Listing keys
//!
//! Every Edge lists the keys every couple of seconds. That is answered
//! from a local book fed by a watch of the keys bucket (one ordered
//! consumer per store, as the journal's directory is fed; loaded at
//! start), so it costs the server nothing per listing; a change shows on
//! every Edge within the watch's lag. A store's own key writes show in
//! its listing at once; [`key`](TenantStore::key) reads the stored value
//! fresh. While the connection is down a listing fails
//! [`TenantStoreError::Unavailable`] (the Edge keeps the keys it has and
//! knows they may be stale).
//!
//! ## Sweeping
//!
//! A sweep lists the two counter buckets and purges every counter whose
//! window is over ([`counter_expired`]); the rate bucket's `max_age`
//! forgets minute windows even when nobody sweeps. Usage rows are left to
//! their bucket's `max_age` and not counted. (A claim racing a purge of
//! its window — an Edge whose clock is minutes behind — starts that
//! window's count again.)
//!
//! ## Failures
//!
//! Every operation asks the connection's state first: while it is down,
//! [`TenantStoreError::Unavailable`] at once. Otherwise every read and
//! write waits at most the store's `request_timeout`; a listing waits at
//! most that long for each of its messages.

use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::{
    self,
    consumer::DeliverPolicy,
    stream::{DirectGetErrorKind, LastRawMessageErrorKind, Stream},
};
use bytes::Bytes;
use futures::StreamExt;
use iop_core::tenant::keys::KeyRecord;
use iop_core::tenant::usage::{UsageKey, UsageQuery, UsageTotals};
use iop_core::tenant::{
    ClaimedCounter, CounterKey, DAY_MS, GiveBackOutcome, check_claim, check_give_back,
};
use iop_store::BoxFuture;
use iop_store::tenant::{
    TenantStore, TenantStoreError, USAGE_RETENTION_DAYS, UsageWriteError, counter_expired,
};

use crate::ConnectError;
use crate::error::{Failure, publish_failure};
use crate::follow::{self, Watch, is_marker};
use crate::options::NatsOptions;
use crate::setup::{self, Bucket};

mod key_book;
mod layout;

use key_book::{KeyBook, KeyFollower};
use layout::{
    KEY_KEY_PREFIX, TenantNames, counter_key, decode_counter, decode_key, decode_slots,
    decode_usage, encode_counter, encode_key, encode_slots, encode_usage, key_key, subject,
    usage_filter, usage_key,
};

/// How long a minute window's counter stays in the rates bucket after its
/// last write: far past the window's end, whatever the Edges' clocks.
pub const RATE_COUNTER_MAX_AGE: Duration = Duration::from_secs(10 * 60);

/// Read-decide-write rounds of one claim or one usage row before it fails
/// under contention (each lost round means another write won).
pub const MAX_CAS_ATTEMPTS: usize = 64;

/// The longest random pause after a lost round, ms (the pause grows with
/// the rounds lost, up to this).
const MAX_BACKOFF_MS: u64 = 16;

/// Usage rows added at once.
const USAGE_CONCURRENCY: usize = 16;

/// Counters one sweep purges at most.
const MAX_SWEEP_PURGES: usize = 10_000;

/// Tenants' state on NATS (see the module docs).
pub(crate) struct NatsTenantStore {
    client: async_nats::Client,
    js: jetstream::Context,
    names: TenantNames,
    rates: Stream,
    budgets: Stream,
    usage: Stream,
    keys: Stream,
    book: Arc<Mutex<KeyBook>>,
    follower: tokio::task::JoinHandle<()>,
    request_timeout: Duration,
}

impl Drop for NatsTenantStore {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// A bucket key's last entry: its revision (0: none) and value (`None`:
/// absent or deleted).
struct Slot {
    revision: u64,
    value: Option<Bytes>,
}

/// What a read-decide-write round decided.
enum Decision<T> {
    /// Nothing to write: the answer.
    Done(T),
    /// Write this value; the answer once it is written.
    Write(Bytes, T),
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> TenantStoreError {
    TenantStoreError::Unavailable(format!("{what}: {e}"))
}

fn write_error(what: &str, f: Failure) -> TenantStoreError {
    match f {
        Failure::Conflict => unavailable(what, "too much contention"),
        Failure::Full => unavailable(what, "the bucket is full (tenant_bucket_max_bytes)"),
        Failure::Store(s) => unavailable(what, s),
    }
}

/// A short random pause after `lost` lost rounds, so racing writers
/// spread out.
async fn backoff(lost: usize) {
    let cap_ms = (1u64 << lost.min(8)).min(MAX_BACKOFF_MS);
    let pause_ms = std::collections::hash_map::RandomState::new().hash_one(lost) % (cap_ms + 1);
    tokio::time::sleep(Duration::from_millis(pause_ms)).await;
}

impl NatsTenantStore {
    /// Make (or check) the buckets and load the keys, on `client`.
    pub(crate) async fn open(
        client: async_nats::Client,
        js: jetstream::Context,
        opts: &NatsOptions,
    ) -> Result<Self, ConnectError> {
        let names = TenantNames::new(&opts.bucket);
        let bucket = |name: &str, description, max_age| Bucket {
            name: name.to_owned(),
            description,
            max_bytes: opts.tenant_bucket_max_bytes,
            max_bytes_field: "[journal.nats] tenant_bucket_max_bytes (by default 256 MiB)",
            max_age,
        };
        let retention = Duration::from_millis(USAGE_RETENTION_DAYS * DAY_MS);
        let rates = setup::bucket(
            &js,
            opts,
            &bucket(
                &names.rates,
                "iop tenants: rate counters per minute",
                RATE_COUNTER_MAX_AGE,
            ),
        )
        .await?;
        let budgets = setup::bucket(
            &js,
            opts,
            &bucket(
                &names.budgets,
                "iop tenants: spend counters per budget period",
                Duration::ZERO,
            ),
        )
        .await?;
        let usage = setup::bucket(
            &js,
            opts,
            &bucket(&names.usage, "iop tenants: usage per day", retention),
        )
        .await?;
        let keys = setup::bucket(
            &js,
            opts,
            &bucket(&names.keys, "iop tenants: runtime API keys", Duration::ZERO),
        )
        .await?;
        let book = Arc::new(Mutex::new(KeyBook::default()));
        let kv_prefix = format!("$KV.{}.", names.keys);
        let follower = follow::start(
            keys.clone(),
            client.clone(),
            Watch {
                filter_subject: format!("{kv_prefix}{KEY_KEY_PREFIX}>"),
                description: "iop tenants: key book",
            },
            Arc::new(KeyFollower {
                book: book.clone(),
                kv_prefix,
            }),
            opts.connect_timeout,
        )
        .await?;
        Ok(NatsTenantStore {
            client,
            js,
            names,
            rates,
            budgets,
            usage,
            keys,
            book,
            follower,
            request_timeout: opts.request_timeout,
        })
    }

    /// Fail at once while the connection is down (it reconnects by
    /// itself): the Edge falls back without waiting for a timeout.
    fn reachable(&self) -> Result<(), TenantStoreError> {
        match self.client.connection_state() {
            async_nats::connection::State::Connected => Ok(()),
            _ => Err(TenantStoreError::Unavailable(
                "not connected to the NATS server (reconnecting)".into(),
            )),
        }
    }

    fn counter_stream(&self, counter: &CounterKey) -> (&Stream, &str) {
        let bucket = self.names.counter_bucket(counter);
        let stream = if bucket == self.names.budgets {
            &self.budgets
        } else {
            &self.rates
        };
        (stream, bucket)
    }

    /// The last entry of `subject`: a direct read (any replica), or from
    /// the stream's leader (never behind a write that was acknowledged).
    async fn read(
        &self,
        stream: &Stream,
        subject: &str,
        leader: bool,
    ) -> Result<Slot, TenantStoreError> {
        let (revision, headers, payload) = if leader {
            match stream.get_last_raw_message_by_subject(subject).await {
                Ok(m) => (m.sequence, Some(m.headers), m.payload),
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                    return Ok(Slot {
                        revision: 0,
                        value: None,
                    });
                }
                Err(e) => return Err(unavailable("reading the tenants' bucket", e)),
            }
        } else {
            match stream.direct_get_last_for_subject(subject).await {
                Ok(m) => (m.sequence, Some(m.headers), m.payload),
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => {
                    return Ok(Slot {
                        revision: 0,
                        value: None,
                    });
                }
                Err(e) => return Err(unavailable("reading the tenants' bucket", e)),
            }
        };
        let value = (!is_marker(headers.as_ref())).then_some(payload);
        Ok(Slot { revision, value })
    }

    /// Write `value` to `subject` if its last revision is still
    /// `expected` (0: none): the new revision.
    async fn write(&self, subject: &str, expected: u64, value: Bytes) -> Result<u64, Failure> {
        let mut headers = HeaderMap::new();
        headers.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected.to_string().as_str(),
        );
        let ack = self
            .js
            .publish_with_headers(subject.to_owned(), headers, value)
            .await
            .map_err(|e| publish_failure("writing the tenants' bucket", e))?
            .await
            .map_err(|e| publish_failure("writing the tenants' bucket", e))?;
        Ok(ack.sequence)
    }

    /// Read `subject`, decide on its value with `decide`, write by
    /// compare-and-set; again on a lost race, at most
    /// [`MAX_CAS_ATTEMPTS`] rounds.
    async fn update<T>(
        &self,
        stream: &Stream,
        subject: &str,
        decide: impl Fn(Option<&Bytes>) -> Result<Decision<T>, TenantStoreError>,
    ) -> Result<T, TenantStoreError> {
        let mut leader = false;
        for lost in 0..MAX_CAS_ATTEMPTS {
            let slot = self.read(stream, subject, leader).await?;
            let (value, answer) = match decide(slot.value.as_ref())? {
                Decision::Done(answer) => return Ok(answer),
                Decision::Write(value, answer) => (value, answer),
            };
            match self.write(subject, slot.revision, value).await {
                Ok(_) => return Ok(answer),
                Err(Failure::Conflict) => {
                    leader = true;
                    backoff(lost).await;
                }
                Err(f) => return Err(write_error("writing the tenants' bucket", f)),
            }
        }
        Err(write_error(
            "writing the tenants' bucket",
            Failure::Conflict,
        ))
    }

    async fn add_row(&self, row: &UsageKey, add: &UsageTotals) -> Result<(), TenantStoreError> {
        let subject = subject(&self.names.usage, &usage_key(row));
        self.update(&self.usage, &subject, |stored| {
            let mut sum = match stored {
                Some(bytes) => {
                    let (stored_row, totals) =
                        decode_usage(bytes).map_err(|e| unavailable("reading a usage row", e))?;
                    if stored_row != *row {
                        return Err(unavailable("reading a usage row", "another row's key"));
                    }
                    totals
                }
                None => UsageTotals::default(),
            };
            sum.add(add);
            let value =
                encode_usage(row, &sum).map_err(|e| unavailable("encoding a usage row", e))?;
            Ok(Decision::Write(value, ()))
        })
        .await
    }

    /// Every value of `stream` under `filter` (a subject filter) as it
    /// stands, each handed to `each`; waits at most `request_timeout` for
    /// each message.
    async fn list(
        &self,
        stream: &Stream,
        filter: String,
        description: &'static str,
        mut each: impl FnMut(&jetstream::Message),
    ) -> Result<(), TenantStoreError> {
        let what = "listing the tenants' bucket";
        // Done at the stream's last message when the listing began, or when
        // nothing is pending: while Edges keep writing, the pending count
        // may not fall to zero for a long time.
        let last = tokio::time::timeout(self.request_timeout, stream.get_info())
            .await
            .map_err(|_| unavailable(what, "no answer in time"))?
            .map_err(|e| unavailable(what, e))?
            .state
            .last_sequence;
        let watch = Watch {
            filter_subject: filter,
            description,
        };
        let (mut pending, mut messages) =
            follow::consumer(stream, &self.client, &watch, DeliverPolicy::LastPerSubject)
                .await
                .map_err(|e| unavailable(what, e))?;
        while pending > 0 {
            let message = match tokio::time::timeout(self.request_timeout, messages.next()).await {
                Ok(Some(Ok(message))) => message,
                Ok(Some(Err(e))) => return Err(unavailable(what, e)),
                Ok(None) => return Err(unavailable(what, "the listing ended")),
                Err(_) => return Err(unavailable(what, "no message in time")),
            };
            pending = match message.info() {
                Ok(i) if i.stream_sequence >= last => 0,
                Ok(i) => i.pending,
                Err(_) => 0,
            };
            each(&message);
        }
        Ok(())
    }

    /// `counter` as `stored` holds it (nothing stored: nothing claimed).
    fn stored_counter(
        &self,
        counter: &CounterKey,
        stored: Option<&Bytes>,
    ) -> Result<ClaimedCounter, TenantStoreError> {
        let Some(bytes) = stored else {
            return Ok(ClaimedCounter::default());
        };
        let (stored_counter, stored) =
            decode_counter(bytes).map_err(|e| unavailable("reading a counter", e))?;
        if stored_counter != *counter {
            return Err(unavailable("reading a counter", "another counter's key"));
        }
        Ok(stored)
    }

    /// Purge the counters of `stream` whose windows are over: how many.
    async fn sweep_counters(
        &self,
        stream: &Stream,
        bucket: &str,
        now_unix_ms: u64,
    ) -> Result<usize, TenantStoreError> {
        let mut due = Vec::new();
        self.list(
            stream,
            format!("$KV.{bucket}.>"),
            "iop tenants: sweep",
            |message| {
                if is_marker(message.headers.as_ref()) || due.len() >= MAX_SWEEP_PURGES {
                    return;
                }
                // A concurrency gauge has no window to be over.
                if message.subject.contains(".c.slots.") {
                    return;
                }
                match decode_counter(&message.payload) {
                    Ok((counter, _)) if counter_expired(&counter, now_unix_ms) => {
                        due.push(message.subject.to_string());
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(subject = %message.subject, error = %e, "an unreadable counter"),
                }
            },
        )
        .await?;
        let mut purged = 0;
        for subject in due {
            stream
                .purge()
                .filter(&subject)
                .await
                .map_err(|e| unavailable("purging a counter", e))?;
            purged += 1;
        }
        Ok(purged)
    }
}

impl TenantStore for NatsTenantStore {
    fn claim(
        &self,
        counter: CounterKey,
        amount: u64,
        limit: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let (stream, bucket) = self.counter_stream(&counter);
            let subject = subject(bucket, &counter_key(&counter));
            self.update(stream, &subject, |stored| {
                let mut stored = self.stored_counter(&counter, stored)?;
                // R-TEN-3: the rule decides, on the counter as stored.
                let (total, granted) = check_claim(stored.claimed, amount, limit);
                if granted == 0 {
                    return Ok(Decision::Done(0));
                }
                stored.claimed = total;
                let value = encode_counter(&counter, &stored)
                    .map_err(|e| unavailable("encoding a counter", e))?;
                Ok(Decision::Write(value, granted))
            })
            .await
        })
    }

    fn give_back(
        &self,
        counter: CounterKey,
        holder: String,
        amount: u64,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<GiveBackOutcome, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let (stream, bucket) = self.counter_stream(&counter);
            let subject = subject(bucket, &counter_key(&counter));
            self.update(stream, &subject, |stored| {
                let stored = self.stored_counter(&counter, stored)?;
                // R-TEN-3: the rule decides, on the counter as stored, and
                // its record of who gave back is written with the
                // decrement, in one compare-and-set.
                let (written, outcome) =
                    check_give_back(&stored, &counter, &holder, amount, now_unix_ms);
                let Some(written) = written else {
                    return Ok(Decision::Done(outcome));
                };
                let value = encode_counter(&counter, &written)
                    .map_err(|e| unavailable("encoding a counter", e))?;
                Ok(Decision::Write(value, outcome))
            })
            .await
        })
    }

    fn hold_slots(
        &self,
        ask: iop_core::tenant::slots::SlotAsk,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let counter = &ask.counter;
            let (stream, bucket) = self.counter_stream(counter);
            let subject = subject(bucket, &counter_key(counter));
            self.update(stream, &subject, |stored| {
                let mut book = match stored {
                    Some(bytes) => {
                        let (stored_counter, book) =
                            decode_slots(bytes).map_err(|e| unavailable("reading a gauge", e))?;
                        if stored_counter != *counter {
                            return Err(unavailable("reading a gauge", "another gauge's key"));
                        }
                        book
                    }
                    None => Default::default(),
                };
                // R-TEN-1, R-TEN-3: the rule decides, on the gauge as stored.
                let before = book.clone();
                let held = book.hold_ask(&ask);
                if book == before {
                    return Ok(Decision::Done(held));
                }
                let value =
                    encode_slots(counter, &book).map_err(|e| unavailable("encoding a gauge", e))?;
                Ok(Decision::Write(value, held))
            })
            .await
        })
    }

    fn slots(
        &self,
        counter: CounterKey,
    ) -> BoxFuture<'_, Result<iop_core::tenant::slots::SlotBook, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let (stream, bucket) = self.counter_stream(&counter);
            let slot = self
                .read(stream, &subject(bucket, &counter_key(&counter)), false)
                .await?;
            match slot.value {
                None => Ok(Default::default()),
                Some(bytes) => decode_slots(&bytes)
                    .map(|(_, book)| book)
                    .map_err(|e| unavailable("reading a gauge", e)),
            }
        })
    }

    fn claimed(&self, counter: CounterKey) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let (stream, bucket) = self.counter_stream(&counter);
            let slot = self
                .read(stream, &subject(bucket, &counter_key(&counter)), false)
                .await?;
            match slot.value {
                None => Ok(0),
                Some(bytes) => decode_counter(&bytes)
                    .map(|(_, stored)| stored.claimed)
                    .map_err(|e| unavailable("reading a counter", e)),
            }
        })
    }

    fn add_usage(
        &self,
        rows: Vec<(UsageKey, UsageTotals)>,
    ) -> BoxFuture<'_, Result<(), UsageWriteError>> {
        Box::pin(async move {
            if let Err(error) = self.reachable() {
                return Err(UsageWriteError {
                    error,
                    unwritten: rows,
                });
            }
            let results = futures::stream::iter(rows)
                .map(|(row, totals)| async move {
                    let result = self.add_row(&row, &totals).await;
                    (row, totals, result)
                })
                .buffer_unordered(USAGE_CONCURRENCY)
                .collect::<Vec<_>>()
                .await;
            let mut first_error = None;
            let mut unwritten = Vec::new();
            for (row, totals, result) in results {
                if let Err(e) = result {
                    first_error.get_or_insert(e);
                    unwritten.push((row, totals));
                }
            }
            match first_error {
                None => Ok(()),
                Some(error) => Err(UsageWriteError { error, unwritten }),
            }
        })
    }

    fn usage(
        &self,
        query: UsageQuery,
    ) -> BoxFuture<'_, Result<Vec<(UsageKey, UsageTotals)>, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            if query.max_rows == 0 || query.from_day_unix_ms > query.to_day_unix_ms {
                return Ok(Vec::new());
            }
            // The first `max_rows` in key order, whatever order the
            // listing delivers: memory stays within the query's bound.
            let mut first: BTreeMap<UsageKey, UsageTotals> = BTreeMap::new();
            self.list(
                &self.usage,
                subject(&self.names.usage, &usage_filter(&query)),
                "iop tenants: usage query",
                |message| {
                    if is_marker(message.headers.as_ref()) {
                        return;
                    }
                    match decode_usage(&message.payload) {
                        Ok((row, totals)) if query.matches(&row) => {
                            first.insert(row, totals);
                            if first.len() > query.max_rows {
                                first.pop_last();
                            }
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(subject = %message.subject, error = %e, "an unreadable usage row"),
                    }
                },
            )
            .await?;
            Ok(first.into_iter().collect())
        })
    }

    fn put_key(
        &self,
        record: KeyRecord,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let key = key_key(&record.id);
            let subject = subject(&self.names.keys, &key);
            let value = encode_key(&record).map_err(|e| unavailable("encoding a key", e))?;
            match self.write(&subject, expected, value).await {
                Ok(revision) => {
                    key_book::lock(&self.book).put(&key, record, revision);
                    Ok(revision)
                }
                Err(Failure::Conflict) => {
                    let current = self.read(&self.keys, &subject, true).await?.revision;
                    if current == expected {
                        // Replaced and back again in between: not a
                        // revision this writer can name.
                        return Err(write_error("writing a key", Failure::Conflict));
                    }
                    Err(TenantStoreError::Conflict { current })
                }
                Err(f) => Err(write_error("writing a key", f)),
            }
        })
    }

    fn key(&self, id: String) -> BoxFuture<'_, Result<Option<(KeyRecord, u64)>, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let key = key_key(&id);
            let slot = self
                .read(&self.keys, &subject(&self.names.keys, &key), true)
                .await?;
            let Some(bytes) = slot.value else {
                return Ok(None);
            };
            let record = decode_key(&bytes).map_err(|e| unavailable("reading a key", e))?;
            key_book::lock(&self.book).put(&key, record.clone(), slot.revision);
            Ok(Some((record, slot.revision)))
        })
    }

    fn keys(&self) -> BoxFuture<'_, Result<Vec<(KeyRecord, u64)>, TenantStoreError>> {
        let keys = self.reachable().map(|()| key_book::lock(&self.book).all());
        Box::pin(async move { keys })
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, TenantStoreError>> {
        Box::pin(async move {
            self.reachable()?;
            let rates = self
                .sweep_counters(&self.rates, &self.names.rates, now_unix_ms)
                .await?;
            let budgets = self
                .sweep_counters(&self.budgets, &self.names.budgets, now_unix_ms)
                .await?;
            Ok(rates + budgets)
        })
    }
}
