//! The task that opens the journal store (R-JRN-6), carrying out
//! [`Availability`]: an Edge serves from its first moment, and its store
//! (the embedded file, or NATS) is opened here, in the background, as
//! often as it takes, with the machine's bounded backoff between
//! attempts. One attempt opens the store, takes this Edge's ownership
//! lease (R-TAKE-1, R-TAKE-2) and reads its unfinished records; only then
//! does the store go into the slot ([`super::slot`]) and durable requests
//! get served. While it is up the task renews the lease, and a store that
//! asks to be reopened ([`JournalStore::needs_reopen`]) is closed and
//! opened again.
//!
//! Nothing here decides when: the machine does; this task opens, waits
//! and tells.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use iop_core::journal::availability::{
    Availability, AvailabilityInput, AvailabilityOutput, OpenFailure, StoreState,
};
use iop_core::journal::{JournalLimits, RecordMeta};
use iop_store::{EmbeddedOptions, EmbeddedStore, MemoryStore, MemoryTenantStore};
use iop_trace::{AvailabilityConfigRec, Driven, MachineKind, Tap, TraceFiles};

use super::slot::Opened;
use super::{Durable, HeldLease, LeaseError};

/// How often the task asks an open store whether it must be reopened
/// (besides being woken by a failed operation).
const REOPEN_CHECK: Duration = Duration::from_secs(1);

/// What store to open, and how.
pub(crate) enum Opener {
    /// Process memory (never fails).
    Memory(JournalLimits),
    /// The embedded file.
    Embedded {
        path: PathBuf,
        limits: JournalLimits,
        options: EmbeddedOptions,
    },
    /// NATS JetStream.
    Nats(Box<iop_store_nats::NatsOptions>),
}

/// Why an attempt failed: the machine's code and the detail for the log.
#[derive(Debug)]
pub(crate) struct Failed {
    pub(crate) why: OpenFailure,
    pub(crate) detail: String,
}

/// Why an attempt ended without the store.
enum AttemptError {
    /// Try again later.
    Failed(Failed),
    /// The store refuses this Edge for good (R-TAKE-2).
    InUse(LeaseError),
}

/// What an attempt that succeeded brings.
struct Up {
    opened: Opened,
    lease: HeldLease,
    unfinished: Vec<RecordMeta>,
}

impl Opener {
    /// What the logs call it: the file, or the servers.
    pub(crate) fn describe(&self) -> String {
        match self {
            Opener::Memory(_) => "memory".into(),
            Opener::Embedded { path, .. } => path.display().to_string(),
            Opener::Nats(o) => o.servers.join(","),
        }
    }

    /// Open the store once.
    async fn open(&self) -> Result<Opened, Failed> {
        match self {
            Opener::Memory(limits) => Ok(Opened {
                journal: Arc::new(MemoryStore::new(*limits)),
                tenants: Arc::new(MemoryTenantStore::new()),
            }),
            Opener::Embedded {
                path,
                limits,
                options,
            } => {
                let (path, limits, options) = (path.clone(), *limits, *options);
                let opened = tokio::task::spawn_blocking(move || {
                    EmbeddedStore::open_with(&path, limits, options)
                })
                .await
                .map_err(|e| Failed {
                    why: OpenFailure::Unreachable,
                    detail: format!("the open task failed: {e}"),
                })?;
                match opened {
                    Ok(store) => {
                        let tenants = store.tenant_store();
                        Ok(Opened {
                            journal: Arc::new(store),
                            tenants,
                        })
                    }
                    Err(e) => Err(Failed {
                        why: embedded_failure(&e),
                        detail: e.to_string(),
                    }),
                }
            }
            Opener::Nats(options) => {
                let connected = async {
                    let store = iop_store_nats::NatsStore::connect((**options).clone()).await?;
                    let tenants = store.tenant_store().await?;
                    Ok::<_, iop_store_nats::ConnectError>((store, tenants))
                };
                match connected.await {
                    Ok((store, tenants)) => Ok(Opened {
                        journal: Arc::new(store),
                        tenants,
                    }),
                    Err(e) => Err(Failed {
                        why: nats_failure(&e),
                        detail: e.to_string(),
                    }),
                }
            }
        }
    }
}

/// The machine's code for an embedded file that did not open.
fn embedded_failure(e: &iop_store::OpenError) -> OpenFailure {
    use iop_store::OpenError as E;
    match e {
        E::AlreadyOpen { .. } => OpenFailure::Busy,
        E::Corrupt { .. } => OpenFailure::Damaged,
        E::NotAJournal { .. } | E::UnknownFormat { .. } | E::Limits { .. } => {
            OpenFailure::Incompatible
        }
        _ => OpenFailure::Unreachable,
    }
}

/// The machine's code for a NATS store that did not connect.
fn nats_failure(e: &iop_store_nats::ConnectError) -> OpenFailure {
    use iop_store_nats::ConnectError as E;
    match e {
        E::Incompatible { .. } | E::Options { .. } | E::Credentials { .. } | E::Reserve { .. } => {
            OpenFailure::Incompatible
        }
        E::Load(_) => OpenFailure::Timeout,
        _ => OpenFailure::Unreachable,
    }
}

/// Drop an open store off the async runtime: closing an embedded file
/// waits for its writer thread.
fn close(opened: Opened) {
    tokio::task::spawn_blocking(move || drop(opened));
}

impl Durable {
    /// One attempt: open, take the lease, read the unfinished records.
    async fn attempt(self: Arc<Self>, opener: Arc<Opener>) -> Result<Up, AttemptError> {
        let opened = opener.open().await.map_err(AttemptError::Failed)?;
        let lease = match self.take_lease_on(&*opened.journal).await {
            Ok(lease) => lease,
            Err(e) => {
                close(opened);
                return Err(match e {
                    in_use @ LeaseError::InUse { .. } => AttemptError::InUse(in_use),
                    LeaseError::Store(e) => AttemptError::Failed(Failed {
                        why: OpenFailure::Lease,
                        detail: format!("ownership lease: {e}"),
                    }),
                });
            }
        };
        match opened.journal.unfinished().await {
            Ok(unfinished) => Ok(Up {
                opened,
                lease,
                unfinished,
            }),
            Err(e) => {
                close(opened);
                Err(AttemptError::Failed(Failed {
                    why: OpenFailure::Lease,
                    detail: format!("the unfinished records: {e}"),
                }))
            }
        }
    }

    /// Open the store in the background, for as long as the Edge runs
    /// (see the module docs); `first_up` gets the unfinished records the
    /// first time it is up (the custody's first scan, R-TAKE-1). A store
    /// handed over open (`Durable::with_store`) is up already: `first_up`
    /// reads it at once.
    pub fn spawn_keeper(
        self: &Arc<Self>,
        traces: Arc<TraceFiles>,
        first_up: impl FnOnce(Vec<RecordMeta>) + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let durable = self.clone();
        let opener = self.opener.lock().unwrap_or_else(|e| e.into_inner()).take();
        tokio::spawn(async move {
            match opener {
                Some(opener) => durable.keep(Arc::new(opener), &traces, first_up).await,
                None => {
                    // Handed over open: no attempt to make.
                    let unfinished = durable.store().unfinished().await.unwrap_or_default();
                    first_up(unfinished);
                }
            }
        })
    }

    async fn keep(
        self: Arc<Self>,
        opener: Arc<Opener>,
        traces: &TraceFiles,
        first_up: impl FnOnce(Vec<RecordMeta>) + Send + 'static,
    ) {
        let origin = tokio::time::Instant::now();
        let now = move || {
            iop_core::time::Instant::from_micros(
                u64::try_from(origin.elapsed().as_micros()).unwrap_or(u64::MAX),
            )
        };
        let at = move |t: iop_core::time::Instant| origin + Duration::from_micros(t.as_micros());
        let config = AvailabilityConfigRec {
            created_us: now().as_micros(),
            seed: rand::random(),
        };
        let tap = traces
            .tap(MachineKind::StoreAvailability, || config)
            .unwrap_or_else(|e| {
                tracing::error!(event = "edge_trace_open_failed", machine = "store-availability", error = %e);
                Tap::off()
            });
        let mut machine = Driven::new(config.build(), tap);
        let mut first_up = Some(first_up);
        let mut attempt: Option<iop_store::BoxFuture<'static, Result<Up, AttemptError>>> = None;
        let mut lease: Option<HeldLease> = None;
        let mut next_renewal = tokio::time::Instant::now();
        let mut reopen_check = tokio::time::interval(REOPEN_CHECK);
        reopen_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let what = opener.describe();
        loop {
            while let Some(output) = machine.poll_output(now()) {
                match output {
                    AvailabilityOutput::Open { attempt: n } => {
                        tracing::debug!(event = "edge_journal_store_opening", attempt = n);
                        attempt = Some(Box::pin(self.clone().attempt(opener.clone())));
                    }
                    AvailabilityOutput::Close => {
                        lease = None;
                        if let Some(old) = self.slot.empty(StoreState::Reopening) {
                            close(old);
                        }
                    }
                    AvailabilityOutput::Changed { from, to } => {
                        if to != StoreState::Up
                            && let Some(old) = self.slot.empty(to)
                        {
                            close(old);
                        }
                        if to == StoreState::Up {
                            tracing::info!(
                                event = "edge_journal_store_up",
                                store = %what,
                                from = from.as_str(),
                                "durable requests are served"
                            );
                        } else {
                            tracing::warn!(
                                event = "edge_journal_store_down",
                                store = %what,
                                state = to.as_str(),
                                "durable requests get 503 until the store is back; ephemeral ones are served"
                            );
                        }
                    }
                }
            }
            self.publish_availability(&machine.machine().view(), now());
            let timer = machine.poll_timeout();
            tokio::select! {
                result = in_flight(&mut attempt), if attempt.is_some() => {
                    attempt = None;
                    self.first_attempt.send_replace(true);
                    match result {
                        Ok(up) => {
                            let renew_every = up.lease.lease.renew_interval();
                            self.slot.fill(up.opened);
                            lease = Some(up.lease);
                            next_renewal = tokio::time::Instant::now() + renew_every;
                            machine.handle_input(now(), AvailabilityInput::Opened);
                            self.publish_stats();
                            if let Some(first_up) = first_up.take() {
                                first_up(up.unfinished);
                            }
                        }
                        Err(AttemptError::Failed(f)) => {
                            tracing::warn!(
                                event = "edge_journal_store_open_failed",
                                store = %what,
                                reason = f.why.as_str(),
                                error = %f.detail
                            );
                            machine.handle_input(now(), AvailabilityInput::OpenFailed(f.why));
                        }
                        Err(AttemptError::InUse(e)) => {
                            // R-TAKE-2: never beside the process that
                            // renews this edge_id; the Edge stops.
                            machine.handle_input(now(), AvailabilityInput::Refused);
                            self.refuse(e.to_string());
                        }
                    }
                }
                () = async {
                    match timer {
                        Some(t) => tokio::time::sleep_until(at(t)).await,
                        None => std::future::pending().await,
                    }
                } => machine.handle_timeout(now()),
                () = tokio::time::sleep_until(next_renewal), if lease.is_some() => {
                    if let Some(held) = lease.as_mut() {
                        self.renew(held).await;
                        next_renewal = tokio::time::Instant::now() + held.lease.renew_interval();
                    }
                }
                () = self.keeper_wake.notified() => self.check_reopen(&mut machine, now()),
                _ = reopen_check.tick() => self.check_reopen(&mut machine, now()),
            }
        }
    }

    /// Report an open store that asks to be reopened.
    fn check_reopen(&self, machine: &mut Driven<Availability>, now: iop_core::time::Instant) {
        if machine.machine().state() == StoreState::Up && self.store.needs_reopen() {
            tracing::error!(
                event = "edge_journal_store_broken",
                "the journal store failed an I/O and refuses every write: reopening it"
            );
            machine.handle_input(now, AvailabilityInput::Broken);
        }
    }
}

/// The attempt in flight's answer (never, without one).
async fn in_flight<T>(attempt: &mut Option<iop_store::BoxFuture<'static, T>>) -> T {
    match attempt.as_mut() {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}
