//! The per-provider health tracker (R-HT-1..6).
//!
//! [`HealthTracker`] keeps, for every configured provider and isolated from
//! every other provider (R-HT-1), a [`HealthState`], the last success, the
//! consecutive failures, a sanitized [`HealthFailureCode`] and the next
//! retry moment. It decides *when* each provider's probe is due; the shell
//! runs the probe (an exact-target capability check on the provider's node)
//! and reports the outcome.
//!
//! ## Schedule (R-HT-3)
//!
//! Each provider has one next-probe moment:
//!
//! * a provider that is not failing is probed on the regular refresh cadence
//!   (`refresh_interval` after its last probe finished; a new provider at
//!   once);
//! * a failing provider is probed only at or after `next_retry_at` =
//!   failure + `backoff_base * 2^(consecutive_failures - 1)`, held at
//!   `backoff_cap` during a long outage. Neither the regular cadence nor
//!   [`HealthTracker::request_refresh`] ever moves a failing provider's probe
//!   earlier;
//! * on success the provider returns to the regular cadence.
//!
//! At most one probe per provider is in flight. A probe that is not answered
//! within `probe_timeout` counts as a [`HealthFailureCode::Timeout`] failure,
//! and its late answer is ignored (each probe has its own [`ProbeTicket`]).
//!
//! ## Driver loop
//!
//! After every input and on every wake-up: call [`HealthTracker::handle_timeout`],
//! then start a probe for every ticket [`HealthTracker::poll_probe`] returns
//! until `None`, drain [`HealthTracker::poll_event`] and
//! [`HealthTracker::poll_state_change`] (re-evaluate each changed provider's
//! eligibility: a provider can go `stale` by time alone, with no lifecycle
//! event, R-HT-5), and sleep until [`HealthTracker::poll_timeout`]. A due
//! probe keeps `poll_timeout` in the past until `poll_probe` hands it out.
//!
//! State is process-local (R-HT-4): a new tracker knows nothing, treats every
//! provider as [`HealthState::Unknown`] (not available, R-HT-5), and reports
//! the first failure as [`HealthLifecycle::Detected`] again.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use iop_wire::HealthFailureCode;

use crate::ids::ProviderId;
use crate::time::{Instant, earliest};

/// The largest number of providers one tracker follows (bounded state).
pub const MAX_TRACKED_PROVIDERS: usize = 4096;

/// Tracker settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HealthConfig {
    /// The regular capability refresh cadence of a provider that is not
    /// failing.
    pub refresh_interval: Duration,
    /// The first recovery backoff after a failure.
    pub backoff_base: Duration,
    /// The longest recovery backoff (R-HT-3).
    pub backoff_cap: Duration,
    /// How long an `ok` result stays fresh without a new success; after that
    /// the provider is `stale`.
    pub stale_after: Duration,
    /// How long a probe may stay unanswered before it counts as a timeout.
    pub probe_timeout: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            refresh_interval: Duration::from_secs(30),
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(60),
            stale_after: Duration::from_secs(90),
            probe_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a [`HealthConfig`] or an input was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HealthTrackerError {
    /// A duration that must be positive was zero.
    #[error("health tracker setting `{0}` must be greater than zero")]
    ZeroDuration(&'static str),
    /// The backoff base was above its cap.
    #[error("health tracker backoff_base must not exceed backoff_cap")]
    BackoffBaseAboveCap,
    /// The provider limit was reached.
    #[error("the health tracker already follows {MAX_TRACKED_PROVIDERS} providers")]
    TooManyProviders,
    /// `stale_after` does not exceed `refresh_interval + probe_timeout`: a
    /// healthy provider would flap to `stale` between its probes (R-HT-5).
    #[error("health tracker stale_after must exceed refresh_interval + probe_timeout")]
    StaleBeforeNextProbe,
}

impl HealthConfig {
    /// Check the settings; the error names the offending field.
    pub fn validate(&self) -> Result<(), HealthTrackerError> {
        for (name, value) in [
            ("refresh_interval", self.refresh_interval),
            ("backoff_base", self.backoff_base),
            ("backoff_cap", self.backoff_cap),
            ("stale_after", self.stale_after),
            ("probe_timeout", self.probe_timeout),
        ] {
            if value.is_zero() {
                return Err(HealthTrackerError::ZeroDuration(name));
            }
        }
        if self.backoff_base > self.backoff_cap {
            return Err(HealthTrackerError::BackoffBaseAboveCap);
        }
        Ok(())
    }

    /// [`Self::validate`], and what a deployment also needs (R-HT-5): a
    /// healthy provider's regular probe can answer before its `ok` ages
    /// out, so it does not flap to `stale` between probes. (Tests and the
    /// simulator use profiles that age out on purpose.)
    pub fn validate_deployment(&self) -> Result<(), HealthTrackerError> {
        self.validate()?;
        if self.stale_after <= self.refresh_interval.saturating_add(self.probe_timeout) {
            return Err(HealthTrackerError::StaleBeforeNextProbe);
        }
        Ok(())
    }

    /// The recovery backoff after `consecutive_failures` failures (at least
    /// one): `backoff_base * 2^(n - 1)`, never above `backoff_cap` (R-HT-3).
    pub fn backoff(&self, consecutive_failures: u32) -> Duration {
        let doublings = consecutive_failures.saturating_sub(1).min(31);
        self.backoff_base
            .checked_mul(1u32 << doublings)
            .map_or(self.backoff_cap, |d| d.min(self.backoff_cap))
    }
}

/// A provider's health state (R-HT-1). Closed, for the status surface and
/// labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthState {
    /// No probe has answered yet in this process. Not available (R-HT-5).
    Unknown,
    /// The last probe succeeded and is fresh.
    Ok,
    /// The last probe failed.
    Unavailable,
    /// The last success is too old, or its node went away. Not available.
    Stale,
}

impl HealthState {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Unknown => "unknown",
            HealthState::Ok => "ok",
            HealthState::Unavailable => "unavailable",
            HealthState::Stale => "stale",
        }
    }
}

/// An outage lifecycle transition (R-HT-4), each emitted once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthLifecycle {
    /// The first failure after `ok` or `unknown`.
    Detected,
    /// The outage continues (the second consecutive failure).
    Ongoing,
    /// The first success after a failure.
    Recovered,
}

impl HealthLifecycle {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthLifecycle::Detected => "detected",
            HealthLifecycle::Ongoing => "ongoing",
            HealthLifecycle::Recovered => "recovered",
        }
    }
}

/// A lifecycle event for alerts and logs; plain data, no secrets (R-HT-6).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HealthEvent {
    /// Whose outage.
    pub provider_id: ProviderId,
    /// Which transition.
    pub lifecycle: HealthLifecycle,
    /// The sanitized failure code (the last one, for `recovered`).
    pub failure_code: Option<HealthFailureCode>,
    /// Consecutive failures at the transition (before the reset, for
    /// `recovered`).
    pub consecutive_failures: u32,
    /// When the result that caused it arrived.
    pub at: Instant,
}

/// What a probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeResult {
    /// A valid answer, even an empty one such as an empty model list (R-HT-2).
    Success,
    /// A failure, already sanitized into a closed code.
    Failure(HealthFailureCode),
    /// The probe ended without a verdict about the provider (the node's own
    /// probe timed out, could not connect or could not read the answer:
    /// `unknown`, R-CAP-1). It changes nothing: not the state, not the
    /// failure streak. An `ok` provider keeps its regular cadence and goes
    /// `stale` if no verdict comes within `stale_after` (R-HT-5); any other
    /// is probed again after its current backoff.
    NoVerdict(HealthFailureCode),
}

/// A probe the shell must run, handed out by [`HealthTracker::poll_probe`];
/// give it back with the result.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProbeTicket {
    /// Which provider to probe.
    pub provider_id: ProviderId,
    probe_seq: u64,
}

/// What the tracker did with a probe result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[must_use]
pub enum ProbeDisposition {
    /// The result was applied.
    Applied,
    /// The ticket is no longer in flight (timed out, or the provider was
    /// removed); the result changed nothing.
    Stale,
}

/// One provider's health, as the status surface shows it (R-HT-6): states,
/// counters and times only.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProviderHealthSnapshot {
    /// The provider.
    pub provider_id: ProviderId,
    /// Its state.
    pub state: HealthState,
    /// The last successful probe.
    pub last_success_at: Option<Instant>,
    /// The last failed probe.
    pub last_failure_at: Option<Instant>,
    /// Failures since the last success.
    pub consecutive_failures: u32,
    /// The sanitized code of the last failure, while failing.
    pub failure_code: Option<HealthFailureCode>,
    /// The earliest recovery probe, while failing (R-HT-3).
    pub next_retry_at: Option<Instant>,
    /// When the next probe is due (the regular cadence or `next_retry_at`).
    pub next_probe_at: Instant,
    /// Whether a probe is running.
    pub probe_in_flight: bool,
    /// Successful probes in this process.
    pub successes_total: u64,
    /// Failed probes in this process.
    pub failures_total: u64,
    /// Probes that ended without a verdict in this process (R-CAP-1).
    pub no_verdicts_total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outage {
    None,
    Detected,
    Ongoing,
}

#[derive(Debug, Clone)]
struct InFlight {
    probe_seq: u64,
    started_at: Instant,
}

#[derive(Debug, Clone)]
struct ProviderEntry {
    state: HealthState,
    last_success_at: Option<Instant>,
    last_failure_at: Option<Instant>,
    consecutive_failures: u32,
    failure_code: Option<HealthFailureCode>,
    next_retry_at: Option<Instant>,
    next_probe_at: Instant,
    in_flight: Option<InFlight>,
    outage: Outage,
    successes_total: u64,
    failures_total: u64,
    /// Probes that ended without a verdict ([`ProbeResult::NoVerdict`]).
    no_verdicts_total: u64,
    /// Its node has no ready connection: nothing to probe through.
    suspended: bool,
    /// Run and tunnel failures in a row since its last successful run
    /// (R-FAIL-3).
    run_failures: u32,
    /// Outages its runs caused since its last successful run: a provider
    /// whose probe answers but whose runs keep failing backs off longer
    /// each time (R-HT-3), even though each probe success resets
    /// `consecutive_failures`.
    run_trips: u32,
}

impl ProviderEntry {
    fn new(now: Instant) -> Self {
        Self {
            state: HealthState::Unknown,
            last_success_at: None,
            last_failure_at: None,
            consecutive_failures: 0,
            failure_code: None,
            next_retry_at: None,
            next_probe_at: now,
            in_flight: None,
            suspended: false,
            run_failures: 0,
            run_trips: 0,
            outage: Outage::None,
            successes_total: 0,
            failures_total: 0,
            no_verdicts_total: 0,
        }
    }

    fn snapshot(&self, provider_id: &ProviderId) -> ProviderHealthSnapshot {
        ProviderHealthSnapshot {
            provider_id: provider_id.clone(),
            state: self.state,
            last_success_at: self.last_success_at,
            last_failure_at: self.last_failure_at,
            consecutive_failures: self.consecutive_failures,
            failure_code: self.failure_code,
            next_retry_at: self.next_retry_at,
            next_probe_at: self.next_probe_at,
            probe_in_flight: self.in_flight.is_some(),
            successes_total: self.successes_total,
            failures_total: self.failures_total,
            no_verdicts_total: self.no_verdicts_total,
        }
    }

    /// The earliest moment this entry needs the driver.
    fn wake_at(&self, config: &HealthConfig) -> Option<Instant> {
        let probe = match &self.in_flight {
            Some(probe) => Some(probe.started_at.saturating_add(config.probe_timeout)),
            None if self.suspended => None,
            None => Some(self.next_probe_at),
        };
        let stale = match (self.state, self.last_success_at) {
            (HealthState::Ok, Some(at)) => Some(at.saturating_add(config.stale_after)),
            _ => None,
        };
        earliest(probe, stale)
    }
}

/// Per-provider health, isolated per provider (R-HT-1..6). See the
/// [module docs](self) for the schedule and the driver loop.
#[derive(Debug, Clone)]
pub struct HealthTracker {
    config: HealthConfig,
    providers: BTreeMap<ProviderId, ProviderEntry>,
    next_probe_seq: u64,
    events: VecDeque<HealthEvent>,
    /// Providers whose state changed and were not yet polled; bounded by
    /// the providers followed.
    changed: BTreeSet<ProviderId>,
}

impl HealthTracker {
    /// A tracker that knows no provider yet.
    pub fn new(config: HealthConfig) -> Result<Self, HealthTrackerError> {
        config.validate()?;
        Ok(Self {
            config,
            providers: BTreeMap::new(),
            next_probe_seq: 0,
            events: VecDeque::new(),
            changed: BTreeSet::new(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &HealthConfig {
        &self.config
    }

    /// Follow `provider_id`, state `unknown`, first probe due at once.
    /// Adding a provider that is already followed changes nothing.
    pub fn add_provider(
        &mut self,
        now: Instant,
        provider_id: ProviderId,
    ) -> Result<(), HealthTrackerError> {
        if self.providers.contains_key(&provider_id) {
            return Ok(());
        }
        if self.providers.len() >= MAX_TRACKED_PROVIDERS {
            return Err(HealthTrackerError::TooManyProviders);
        }
        self.providers.insert(provider_id, ProviderEntry::new(now));
        Ok(())
    }

    /// Stop following `provider_id`; its probe in flight, if any, becomes
    /// stale. Returns whether it was followed.
    pub fn remove_provider(&mut self, provider_id: &ProviderId) -> bool {
        self.changed.remove(provider_id);
        self.providers.remove(provider_id).is_some()
    }

    /// The next probe to start at `now`, marked in flight; call until `None`.
    /// A failing provider is never handed out before its `next_retry_at`
    /// (R-HT-3), and no provider has two probes in flight.
    #[must_use]
    pub fn poll_probe(&mut self, now: Instant) -> Option<ProbeTicket> {
        let (provider_id, entry) = self
            .providers
            .iter_mut()
            .find(|(_, e)| !e.suspended && e.in_flight.is_none() && e.next_probe_at <= now)?;
        debug_assert!(retry_respected(entry, now));
        self.next_probe_seq += 1;
        entry.in_flight = Some(InFlight {
            probe_seq: self.next_probe_seq,
            started_at: now,
        });
        Some(ProbeTicket {
            provider_id: provider_id.clone(),
            probe_seq: self.next_probe_seq,
        })
    }

    /// Apply a probe's result at `now`. Only the provider named on the
    /// ticket changes (R-HT-1).
    pub fn probe_result(
        &mut self,
        now: Instant,
        ticket: &ProbeTicket,
        result: ProbeResult,
    ) -> ProbeDisposition {
        let Some(entry) = self.providers.get_mut(&ticket.provider_id) else {
            return ProbeDisposition::Stale;
        };
        match &entry.in_flight {
            Some(probe) if probe.probe_seq == ticket.probe_seq => {}
            _ => return ProbeDisposition::Stale,
        }
        entry.in_flight = None;
        if let ProbeResult::NoVerdict(_) = result {
            // The streak stays; a failing provider's backoff starts again
            // from now (R-HT-3: never sooner than that).
            let wait = if entry.state == HealthState::Ok {
                self.config.refresh_interval
            } else {
                self.config.backoff(entry.consecutive_failures.max(1))
            };
            entry.next_probe_at = now.saturating_add(wait);
            if entry.next_retry_at.is_some() {
                entry.next_retry_at = Some(entry.next_probe_at);
            }
            entry.no_verdicts_total = entry.no_verdicts_total.saturating_add(1);
            return ProbeDisposition::Applied;
        }
        let before = entry.state;
        if let Some(event) = apply_result(&self.config, &ticket.provider_id, entry, now, result) {
            self.events.push_back(event);
        }
        if entry.state != before {
            self.changed.insert(ticket.provider_id.clone());
        }
        ProbeDisposition::Applied
    }

    /// A run or tunnel of `provider_id` ended (R-FAIL-3): a success ends
    /// its streak of run failures; the [`RUN_FAILURES_TO_UNAVAILABLE`]th
    /// failure in a row counts as a failed probe: the provider becomes
    /// `unavailable`, its outage is reported (R-HT-4) and its recovery
    /// probe waits for the capped backoff (R-HT-3). Only that provider
    /// changes (R-HT-1). Returns whether its state changed.
    pub fn run_outcome(
        &mut self,
        now: Instant,
        provider_id: &ProviderId,
        outcome: RunHealth,
    ) -> bool {
        let Some(entry) = self.providers.get_mut(provider_id) else {
            return false;
        };
        match outcome {
            RunHealth::Neutral => false,
            RunHealth::Succeeded => {
                entry.run_failures = 0;
                entry.run_trips = 0;
                false
            }
            RunHealth::Failed(code) => {
                entry.run_failures = entry.run_failures.saturating_add(1);
                if entry.run_failures < RUN_FAILURES_TO_UNAVAILABLE {
                    return false;
                }
                entry.run_failures = 0;
                entry.run_trips = entry.run_trips.saturating_add(1);
                // The backoff grows with every outage since the last good
                // run, not only with failed probes in a row.
                entry.consecutive_failures = entry
                    .consecutive_failures
                    .max(entry.run_trips.saturating_sub(1));
                let before = entry.state;
                if let Some(event) = apply_result(
                    &self.config,
                    provider_id,
                    entry,
                    now,
                    ProbeResult::Failure(code),
                ) {
                    self.events.push_back(event);
                }
                let changed = entry.state != before;
                if changed {
                    self.changed.insert(provider_id.clone());
                }
                changed
            }
        }
    }

    /// Mark an `ok` provider `stale` (e.g. its node disconnected). An
    /// `unavailable` provider keeps its state and backoff; an `unknown` one
    /// stays unknown. Returns whether the state changed.
    pub fn mark_stale(&mut self, _now: Instant, provider_id: &ProviderId) -> bool {
        match self.providers.get_mut(provider_id) {
            Some(entry) if entry.state == HealthState::Ok => {
                entry.state = HealthState::Stale;
                self.changed.insert(provider_id.clone());
                true
            }
            _ => false,
        }
    }

    /// The provider's node lost its connection: no probes are issued until
    /// [`Self::resume`], and an `ok` provider becomes `stale` (fail closed,
    /// R-HT-5). A failing provider keeps its backoff. Returns whether it was
    /// followed.
    pub fn suspend(&mut self, now: Instant, provider_id: &ProviderId) -> bool {
        self.mark_stale(now, provider_id);
        match self.providers.get_mut(provider_id) {
            Some(entry) => {
                entry.suspended = true;
                true
            }
            None => false,
        }
    }

    /// The provider's node is ready again: probes resume, a healthy (or
    /// stale) provider's at once; a failing one's still waits for its
    /// `next_retry_at` (R-HT-3).
    pub fn resume(&mut self, now: Instant, provider_id: &ProviderId) -> bool {
        match self.providers.get_mut(provider_id) {
            Some(entry) => {
                entry.suspended = false;
                self.request_refresh(now, provider_id);
                true
            }
            None => false,
        }
    }

    /// Ask for a regular capability refresh of `provider_id` now (e.g. its
    /// node became ready again). Never bypasses the backoff of a failing
    /// provider (R-HT-3). Returns whether a probe was brought forward.
    pub fn request_refresh(&mut self, now: Instant, provider_id: &ProviderId) -> bool {
        match self.providers.get_mut(provider_id) {
            Some(entry)
                if entry.consecutive_failures == 0
                    && entry.in_flight.is_none()
                    && entry.next_probe_at > now =>
            {
                entry.next_probe_at = now;
                true
            }
            _ => false,
        }
    }

    /// Fire the timers due at `now`: unanswered probes become `timeout`
    /// failures, and `ok` results older than `stale_after` become `stale`.
    /// Every provider whose state changed is reported by
    /// [`Self::poll_state_change`].
    pub fn handle_timeout(&mut self, now: Instant) {
        let config = self.config;
        for (provider_id, entry) in &mut self.providers {
            let before = entry.state;
            let timed_out = entry
                .in_flight
                .as_ref()
                .is_some_and(|probe| probe.started_at.saturating_add(config.probe_timeout) <= now);
            if timed_out {
                entry.in_flight = None;
                let timeout = ProbeResult::Failure(HealthFailureCode::Timeout);
                if let Some(event) = apply_result(&config, provider_id, entry, now, timeout) {
                    self.events.push_back(event);
                }
            }
            if entry.state == HealthState::Ok
                && entry
                    .last_success_at
                    .is_some_and(|at| at.saturating_add(config.stale_after) <= now)
            {
                // R-HT-5: no lifecycle event marks this, so the change is
                // reported for the owner to take it out of selection.
                entry.state = HealthState::Stale;
            }
            if entry.state != before {
                self.changed.insert(provider_id.clone());
            }
        }
    }

    /// The earliest moment the tracker needs [`Self::handle_timeout`] or
    /// [`Self::poll_probe`]; `None` with no provider.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.providers
            .values()
            .filter_map(|entry| entry.wake_at(&self.config))
            .min()
    }

    /// The next lifecycle event; call until `None` after every input.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<HealthEvent> {
        self.events.pop_front()
    }

    /// The next provider whose [`HealthState`] changed since it was last
    /// returned (once however many times it changed); call until `None`
    /// after every input. Unlike [`Self::poll_event`] this includes changes
    /// without a lifecycle transition, such as `ok -> stale` by time
    /// (R-HT-5), so whoever derives selection from the state can follow.
    #[must_use]
    pub fn poll_state_change(&mut self) -> Option<ProviderId> {
        self.changed.pop_first()
    }

    /// Whether `provider_id` may be selected: only `ok` is; `unavailable`,
    /// `stale`, `unknown` and unfollowed providers are not (R-HT-5).
    pub fn is_available(&self, provider_id: &ProviderId) -> bool {
        self.state(provider_id) == Some(HealthState::Ok)
    }

    /// The state of `provider_id`, `None` if it is not followed.
    pub fn state(&self, provider_id: &ProviderId) -> Option<HealthState> {
        self.providers.get(provider_id).map(|entry| entry.state)
    }

    /// One provider's status (R-HT-6).
    pub fn provider_snapshot(&self, provider_id: &ProviderId) -> Option<ProviderHealthSnapshot> {
        self.providers
            .get(provider_id)
            .map(|entry| entry.snapshot(provider_id))
    }

    /// Every provider's status, ordered by provider id (R-HT-6).
    pub fn snapshot(&self) -> Vec<ProviderHealthSnapshot> {
        self.providers
            .iter()
            .map(|(provider_id, entry)| entry.snapshot(provider_id))
            .collect()
    }
}

/// Apply one probe result to one provider's entry (and nothing else,
/// R-HT-1); returns the lifecycle event it causes, if any (R-HT-4).
fn apply_result(
    config: &HealthConfig,
    provider_id: &ProviderId,
    entry: &mut ProviderEntry,
    now: Instant,
    result: ProbeResult,
) -> Option<HealthEvent> {
    let event = |lifecycle, failure_code, consecutive_failures| HealthEvent {
        provider_id: provider_id.clone(),
        lifecycle,
        failure_code,
        consecutive_failures,
        at: now,
    };
    match result {
        ProbeResult::Success => {
            // R-HT-2: any valid answer, empty or not, is success; back to
            // the regular cadence (R-HT-3).
            let recovered = (entry.outage != Outage::None).then(|| {
                event(
                    HealthLifecycle::Recovered,
                    entry.failure_code,
                    entry.consecutive_failures,
                )
            });
            entry.state = HealthState::Ok;
            entry.last_success_at = Some(now);
            entry.consecutive_failures = 0;
            entry.failure_code = None;
            entry.next_retry_at = None;
            entry.next_probe_at = now.saturating_add(config.refresh_interval);
            entry.outage = Outage::None;
            entry.successes_total = entry.successes_total.saturating_add(1);
            recovered
        }
        // Handled by the caller: nothing changes.
        ProbeResult::NoVerdict(_) => None,
        ProbeResult::Failure(code) => {
            entry.state = HealthState::Unavailable;
            entry.last_failure_at = Some(now);
            entry.consecutive_failures = entry.consecutive_failures.saturating_add(1);
            entry.failure_code = Some(code);
            // R-HT-3: the recovery probe waits for the capped backoff.
            let retry_at = now.saturating_add(config.backoff(entry.consecutive_failures));
            entry.next_retry_at = Some(retry_at);
            entry.next_probe_at = retry_at;
            entry.failures_total = entry.failures_total.saturating_add(1);
            // R-HT-4: each transition once; a long outage stays `ongoing`.
            let lifecycle = match entry.outage {
                Outage::None => {
                    entry.outage = Outage::Detected;
                    HealthLifecycle::Detected
                }
                Outage::Detected => {
                    entry.outage = Outage::Ongoing;
                    HealthLifecycle::Ongoing
                }
                Outage::Ongoing => return None,
            };
            Some(event(lifecycle, Some(code), entry.consecutive_failures))
        }
    }
}

/// A failing provider's probe is never handed out before `next_retry_at`.
fn retry_respected(entry: &ProviderEntry, now: Instant) -> bool {
    entry.next_retry_at.is_none_or(|at| at <= now)
}

/// Run failures in a row that make a provider `unavailable` (R-FAIL-3):
/// one error is no outage, a provider failing every run is.
pub const RUN_FAILURES_TO_UNAVAILABLE: u32 = 3;

/// What one run or tunnel terminal says of its provider's health
/// (R-FAIL-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunHealth {
    /// The provider answered the run to its end.
    Succeeded,
    /// The provider failed the run, with its class.
    Failed(HealthFailureCode),
    /// Nothing about the provider: the client's error or cancel, a deadline,
    /// the node's capacity or connection, or a stall (whose evidence goes
    /// through the overlay, R-OVL).
    Neutral,
}

/// Classify a run's terminal failure (`None`: it completed) for the
/// provider's health (R-FAIL-3). A provider's own failures count: a 5xx,
/// an unreachable or malformed provider, a refused key or credential.
/// A client's 4xx, a 429 (the provider is alive and busy), a cancel, a
/// deadline, a full node, a lost node connection or a stall do not.
pub fn run_health(failure: Option<&iop_wire::ExecutionFailure>) -> RunHealth {
    use iop_wire::FailureCode as C;
    let Some(f) = failure else {
        return RunHealth::Succeeded;
    };
    match f.code {
        C::CredentialRejected => RunHealth::Failed(HealthFailureCode::CredentialFailed),
        C::ProviderUnreachable => RunHealth::Failed(HealthFailureCode::TransportFailed),
        C::MalformedResponse => RunHealth::Failed(HealthFailureCode::MalformedResponse),
        C::ProviderError => match f.http_status {
            Some(429) => RunHealth::Neutral,
            Some(status) => match classify_http_status(status) {
                Some(HealthFailureCode::Http4xx) | None => RunHealth::Neutral,
                Some(code) => RunHealth::Failed(code),
            },
            None => RunHealth::Failed(
                f.health_failure
                    .unwrap_or(HealthFailureCode::ProviderRejected),
            ),
        },
        C::ResponseStalled
        | C::Canceled
        | C::DeadlineExceeded
        | C::InvalidRequest
        | C::NodeOverloaded
        | C::UnknownTarget
        | C::TransportClosed
        | C::Internal => RunHealth::Neutral,
    }
}

/// The sanitized failure class of a provider's HTTP status (R-HT-1):
/// `None` for 2xx.
pub fn classify_http_status(status: u16) -> Option<HealthFailureCode> {
    match status {
        200..=299 => None,
        401 => Some(HealthFailureCode::AuthenticationFailed),
        403 => Some(HealthFailureCode::AuthorizationFailed),
        400..=499 => Some(HealthFailureCode::Http4xx),
        500..=599 => Some(HealthFailureCode::Http5xx),
        // A probe must get a final 2xx answer; an informational or redirect
        // status is a refusal.
        100..=199 | 300..=399 => Some(HealthFailureCode::ProviderRejected),
        _ => Some(HealthFailureCode::MalformedResponse),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn pid(s: &str) -> ProviderId {
        ProviderId::new(s)
    }

    fn at(secs: u64) -> Instant {
        Instant::from_millis(secs * 1000)
    }

    fn config() -> HealthConfig {
        HealthConfig {
            refresh_interval: 30 * SECOND,
            backoff_base: SECOND,
            backoff_cap: 60 * SECOND,
            stale_after: 90 * SECOND,
            probe_timeout: 10 * SECOND,
        }
    }

    /// A tracker plus the tickets of probes started but not answered yet,
    /// as a shell driver keeps them.
    struct Harness {
        t: HealthTracker,
        outstanding: BTreeMap<String, ProbeTicket>,
    }

    impl std::ops::Deref for Harness {
        type Target = HealthTracker;
        fn deref(&self) -> &HealthTracker {
            &self.t
        }
    }

    impl std::ops::DerefMut for Harness {
        fn deref_mut(&mut self) -> &mut HealthTracker {
            &mut self.t
        }
    }

    fn harness(config: HealthConfig, providers: &[&str]) -> Harness {
        let mut t = HealthTracker::new(config).expect("valid config");
        for p in providers {
            t.add_provider(Instant::ZERO, pid(p)).expect("room");
        }
        Harness {
            t,
            outstanding: BTreeMap::new(),
        }
    }

    fn tracker(providers: &[&str]) -> Harness {
        harness(config(), providers)
    }

    /// Start the due probe of `provider` at `now` and answer it at once.
    fn probe(h: &mut Harness, now: Instant, provider: &str, result: ProbeResult) {
        let ticket = take_probe(h, now, provider).expect("probe due");
        assert_eq!(
            h.t.probe_result(now, &ticket, result),
            ProbeDisposition::Applied
        );
    }

    /// Run the driver step at `now` (timeouts, start every due probe) and
    /// take the outstanding probe of `provider`, if any.
    fn take_probe(h: &mut Harness, now: Instant, provider: &str) -> Option<ProbeTicket> {
        h.t.handle_timeout(now);
        while let Some(ticket) = h.t.poll_probe(now) {
            h.outstanding.insert(ticket.provider_id.0.clone(), ticket);
        }
        h.outstanding.remove(provider)
    }

    fn events(t: &mut HealthTracker) -> Vec<(String, HealthLifecycle)> {
        std::iter::from_fn(|| t.poll_event())
            .map(|e| (e.provider_id.0, e.lifecycle))
            .collect()
    }

    fn fail(code: HealthFailureCode) -> ProbeResult {
        ProbeResult::Failure(code)
    }

    fn run_failed(h: &mut Harness, now: Instant, provider: &str, code: HealthFailureCode) -> bool {
        h.t.run_outcome(now, &pid(provider), RunHealth::Failed(code))
    }

    #[test]
    fn r_fail_3_run_failures_in_a_row_make_only_that_provider_unavailable() {
        let mut t = tracker(&["a", "b"]);
        probe(&mut t, Instant::ZERO, "a", ProbeResult::Success);
        probe(&mut t, Instant::ZERO, "b", ProbeResult::Success);
        let _ = events(&mut t);
        for _ in 1..RUN_FAILURES_TO_UNAVAILABLE {
            assert!(!run_failed(&mut t, at(1), "a", HealthFailureCode::Http5xx));
            assert_eq!(
                t.state(&pid("a")),
                Some(HealthState::Ok),
                "one error is no outage"
            );
        }
        assert!(run_failed(&mut t, at(1), "a", HealthFailureCode::Http5xx));
        assert_eq!(t.state(&pid("a")), Some(HealthState::Unavailable));
        assert_eq!(
            t.state(&pid("b")),
            Some(HealthState::Ok),
            "isolation (R-HT-1)"
        );
        assert_eq!(
            events(&mut t),
            vec![("a".to_owned(), HealthLifecycle::Detected)]
        );
        let snap = t.provider_snapshot(&pid("a")).unwrap();
        assert_eq!(snap.failure_code, Some(HealthFailureCode::Http5xx));
        assert_eq!(snap.next_retry_at, Some(at(1) + SECOND), "R-HT-3 backoff");
        // Its recovery probe comes after the backoff, not before.
        assert!(take_probe(&mut t, at(1), "a").is_none());
        probe(&mut t, at(2), "a", ProbeResult::Success);
        assert_eq!(t.state(&pid("a")), Some(HealthState::Ok));
    }

    #[test]
    fn r_fail_3_a_successful_run_ends_the_streak_and_neutral_outcomes_change_nothing() {
        let mut t = tracker(&["a"]);
        probe(&mut t, Instant::ZERO, "a", ProbeResult::Success);
        for _ in 0..10 {
            for _ in 1..RUN_FAILURES_TO_UNAVAILABLE {
                run_failed(&mut t, at(1), "a", HealthFailureCode::Http5xx);
            }
            assert!(!t.run_outcome(at(1), &pid("a"), RunHealth::Succeeded));
            assert!(!t.run_outcome(at(1), &pid("a"), RunHealth::Neutral));
        }
        assert_eq!(t.state(&pid("a")), Some(HealthState::Ok));
        assert!(!run_failed(
            &mut t,
            at(1),
            "unknown-provider",
            HealthFailureCode::Http5xx
        ));
    }

    #[test]
    fn r_fail_3_a_provider_whose_probe_answers_but_whose_runs_fail_backs_off_longer_each_time() {
        let mut t = tracker(&["a"]);
        probe(&mut t, Instant::ZERO, "a", ProbeResult::Success);
        let mut now = at(1);
        let mut waits = Vec::new();
        for _ in 0..8 {
            for _ in 0..RUN_FAILURES_TO_UNAVAILABLE {
                run_failed(&mut t, now, "a", HealthFailureCode::CredentialFailed);
            }
            let retry = t
                .provider_snapshot(&pid("a"))
                .unwrap()
                .next_retry_at
                .unwrap();
            waits.push(retry.saturating_duration_since(now));
            // The probe answers (a managed target's probe carries no key).
            probe(&mut t, retry, "a", ProbeResult::Success);
            now = retry;
        }
        assert_eq!(waits[0], SECOND);
        assert!(waits.windows(2).all(|w| w[1] >= w[0]), "{waits:?}");
        assert_eq!(*waits.last().unwrap(), 60 * SECOND, "capped: {waits:?}");
    }

    #[test]
    fn r_fail_3_which_terminals_are_the_providers_fault() {
        use iop_wire::{ExecutionFailure, FailureCode as C};
        let with_status = |code, status| {
            let mut f = ExecutionFailure::new(code);
            f.http_status = status;
            f
        };
        let cases = [
            (
                C::ProviderError,
                Some(503),
                RunHealth::Failed(HealthFailureCode::Http5xx),
            ),
            (
                C::ProviderError,
                Some(401),
                RunHealth::Failed(HealthFailureCode::AuthenticationFailed),
            ),
            (C::ProviderError, Some(429), RunHealth::Neutral),
            (C::ProviderError, Some(400), RunHealth::Neutral),
            (
                C::ProviderUnreachable,
                None,
                RunHealth::Failed(HealthFailureCode::TransportFailed),
            ),
            (
                C::MalformedResponse,
                None,
                RunHealth::Failed(HealthFailureCode::MalformedResponse),
            ),
            (
                C::CredentialRejected,
                None,
                RunHealth::Failed(HealthFailureCode::CredentialFailed),
            ),
            (C::ResponseStalled, None, RunHealth::Neutral),
            (C::Canceled, None, RunHealth::Neutral),
            (C::DeadlineExceeded, None, RunHealth::Neutral),
            (C::InvalidRequest, None, RunHealth::Neutral),
            (C::NodeOverloaded, None, RunHealth::Neutral),
            (C::TransportClosed, None, RunHealth::Neutral),
        ];
        for (code, status, expected) in cases {
            assert_eq!(
                run_health(Some(&with_status(code, status))),
                expected,
                "{code:?} {status:?}"
            );
        }
        assert_eq!(run_health(None), RunHealth::Succeeded);
    }

    #[test]
    fn config_is_validated_and_bounded() {
        assert!(HealthTracker::new(HealthConfig::default()).is_ok());
        let zero = HealthConfig {
            probe_timeout: Duration::ZERO,
            ..config()
        };
        assert_eq!(
            zero.validate(),
            Err(HealthTrackerError::ZeroDuration("probe_timeout"))
        );
        let inverted = HealthConfig {
            backoff_base: 120 * SECOND,
            ..config()
        };
        assert_eq!(
            inverted.validate(),
            Err(HealthTrackerError::BackoffBaseAboveCap)
        );

        let mut t = tracker(&[]);
        for i in 0..MAX_TRACKED_PROVIDERS {
            t.add_provider(Instant::ZERO, pid(&format!("p{i}")))
                .expect("room");
        }
        assert_eq!(
            t.add_provider(Instant::ZERO, pid("one-too-many")),
            Err(HealthTrackerError::TooManyProviders)
        );
        // Re-adding a followed provider is not growth.
        assert_eq!(t.add_provider(Instant::ZERO, pid("p0")), Ok(()));
    }

    #[test]
    fn classify_http_status_maps_to_closed_codes() {
        assert_eq!(classify_http_status(200), None);
        assert_eq!(classify_http_status(204), None);
        assert_eq!(
            classify_http_status(401),
            Some(HealthFailureCode::AuthenticationFailed)
        );
        assert_eq!(
            classify_http_status(403),
            Some(HealthFailureCode::AuthorizationFailed)
        );
        assert_eq!(classify_http_status(404), Some(HealthFailureCode::Http4xx));
        assert_eq!(classify_http_status(429), Some(HealthFailureCode::Http4xx));
        assert_eq!(classify_http_status(500), Some(HealthFailureCode::Http5xx));
        assert_eq!(classify_http_status(503), Some(HealthFailureCode::Http5xx));
        assert_eq!(
            classify_http_status(302),
            Some(HealthFailureCode::ProviderRejected)
        );
        assert_eq!(
            classify_http_status(0),
            Some(HealthFailureCode::MalformedResponse)
        );
        assert_eq!(
            classify_http_status(999),
            Some(HealthFailureCode::MalformedResponse)
        );
    }

    #[test]
    fn one_provider_failing_changes_no_other_provider() {
        let mut t = tracker(&["a", "b"]);
        probe(&mut t, Instant::ZERO, "b", ProbeResult::Success);
        let b_before = t.provider_snapshot(&pid("b"));
        probe(&mut t, Instant::ZERO, "a", fail(HealthFailureCode::Http5xx));
        probe(&mut t, at(1), "a", fail(HealthFailureCode::Timeout));
        assert!(t.mark_stale(at(1), &pid("b")) || t.state(&pid("b")) == Some(HealthState::Stale));
        // `a`'s failures left `b` exactly as mark_stale left it.
        let b_after = t.provider_snapshot(&pid("b")).expect("followed");
        let b_before = b_before.expect("followed");
        assert_eq!(
            ProviderHealthSnapshot {
                state: HealthState::Stale,
                ..b_before
            },
            b_after
        );
        assert_eq!(t.state(&pid("a")), Some(HealthState::Unavailable));
        assert_eq!(
            events(&mut t),
            vec![
                ("a".to_owned(), HealthLifecycle::Detected),
                ("a".to_owned(), HealthLifecycle::Ongoing),
            ]
        );
    }

    #[test]
    fn no_recovery_probe_before_next_retry_at() {
        let mut t = tracker(&["a"]);
        probe(
            &mut t,
            at(100),
            "a",
            fail(HealthFailureCode::TransportFailed),
        );
        let snap = t.provider_snapshot(&pid("a")).expect("followed");
        assert_eq!(snap.next_retry_at, Some(at(101)));
        let just_before = Instant::from_micros(at(101).as_micros() - 1);
        assert_eq!(take_probe(&mut t, just_before, "a"), None);
        assert_eq!(t.poll_timeout(), Some(at(101)));
        assert!(take_probe(&mut t, at(101), "a").is_some());
        // One probe in flight at a time.
        assert_eq!(take_probe(&mut t, at(102), "a"), None);
    }

    #[test]
    fn backoff_doubles_and_holds_at_cap_during_long_outage() {
        let mut t = tracker(&["a"]);
        let mut now = Instant::ZERO;
        let mut delays = Vec::new();
        for _ in 0..12 {
            probe(&mut t, now, "a", fail(HealthFailureCode::Http5xx));
            let retry_at = t
                .provider_snapshot(&pid("a"))
                .and_then(|s| s.next_retry_at)
                .expect("failing");
            delays.push((retry_at - now).as_secs());
            now = retry_at;
        }
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]);
        assert_eq!(config().backoff(u32::MAX), 60 * SECOND);
        assert_eq!(config().backoff(1), SECOND);
    }

    #[test]
    fn regular_cadence_does_not_bypass_backoff() {
        let mut t = tracker(&["a"]);
        let mut now = Instant::ZERO;
        // Long outage: backoff at the 60 s cap, above the 30 s refresh cadence.
        for _ in 0..8 {
            probe(&mut t, now, "a", fail(HealthFailureCode::Http5xx));
            now = t
                .provider_snapshot(&pid("a"))
                .and_then(|s| s.next_retry_at)
                .expect("failing");
        }
        let failed_at = t
            .provider_snapshot(&pid("a"))
            .and_then(|s| s.last_failure_at)
            .expect("failed");
        assert_eq!(now - failed_at, 60 * SECOND);
        // The regular cadence (30 s) and an explicit refresh request do not
        // bring the recovery probe forward.
        let cadence = failed_at + 30 * SECOND;
        assert!(!t.request_refresh(cadence, &pid("a")));
        assert_eq!(take_probe(&mut t, cadence, "a"), None);
        assert_eq!(take_probe(&mut t, failed_at + 59 * SECOND, "a"), None);
        assert!(take_probe(&mut t, now, "a").is_some());
    }

    #[test]
    fn success_returns_to_regular_cadence() {
        let mut t = tracker(&["a"]);
        probe(&mut t, Instant::ZERO, "a", fail(HealthFailureCode::Http5xx));
        probe(&mut t, at(1), "a", fail(HealthFailureCode::Http5xx));
        probe(&mut t, at(3), "a", ProbeResult::Success);
        let snap = t.provider_snapshot(&pid("a")).expect("followed");
        assert_eq!(snap.state, HealthState::Ok);
        assert_eq!(snap.consecutive_failures, 0);
        assert_eq!(snap.failure_code, None);
        assert_eq!(snap.next_retry_at, None);
        assert_eq!(snap.next_probe_at, at(33));
        assert_eq!(take_probe(&mut t, at(32), "a"), None);
        probe(&mut t, at(33), "a", ProbeResult::Success);
        assert_eq!(
            t.provider_snapshot(&pid("a")).map(|s| s.next_probe_at),
            Some(at(63))
        );
        // A refresh request brings a healthy provider's probe forward.
        assert!(t.request_refresh(at(40), &pid("a")));
        assert!(take_probe(&mut t, at(40), "a").is_some());
    }

    #[test]
    fn empty_valid_answer_is_success() {
        // The shell validates the answer; an empty model list is a valid
        // answer and is reported as Success (R-HT-2).
        let mut t = tracker(&["a"]);
        probe(&mut t, Instant::ZERO, "a", ProbeResult::Success);
        assert!(t.is_available(&pid("a")));
        assert_eq!(
            t.provider_snapshot(&pid("a"))
                .and_then(|s| s.last_success_at),
            Some(Instant::ZERO)
        );
        assert!(events(&mut t).is_empty());
    }

    #[test]
    fn lifecycle_detected_ongoing_recovered_without_duplicates() {
        let mut t = tracker(&["a"]);
        probe(&mut t, Instant::ZERO, "a", ProbeResult::Success);
        let mut now = Instant::ZERO;
        let next_fail = |t: &mut Harness, now: &mut Instant| {
            *now = t
                .provider_snapshot(&pid("a"))
                .map(|s| s.next_probe_at)
                .expect("followed");
            probe(t, *now, "a", fail(HealthFailureCode::Http5xx));
        };
        for _ in 0..6 {
            next_fail(&mut t, &mut now);
        }
        // A probe timeout during the outage is one more failure, not an alert.
        now = t
            .provider_snapshot(&pid("a"))
            .map(|s| s.next_probe_at)
            .expect("followed");
        assert!(take_probe(&mut t, now, "a").is_some());
        t.handle_timeout(now + 10 * SECOND);
        assert_eq!(
            t.provider_snapshot(&pid("a"))
                .map(|s| (s.consecutive_failures, s.failure_code)),
            Some((7, Some(HealthFailureCode::Timeout)))
        );
        now = t
            .provider_snapshot(&pid("a"))
            .map(|s| s.next_probe_at)
            .expect("followed");
        probe(&mut t, now, "a", ProbeResult::Success);
        now += 30 * SECOND;
        probe(&mut t, now, "a", ProbeResult::Success);
        next_fail(&mut t, &mut now);
        let all: Vec<_> = std::iter::from_fn(|| t.poll_event()).collect();
        let kinds: Vec<_> = all.iter().map(|e| e.lifecycle).collect();
        assert_eq!(
            kinds,
            vec![
                HealthLifecycle::Detected,
                HealthLifecycle::Ongoing,
                HealthLifecycle::Recovered,
                HealthLifecycle::Detected,
            ]
        );
        assert_eq!(all[2].consecutive_failures, 7);
        assert_eq!(all[2].failure_code, Some(HealthFailureCode::Timeout));
    }

    #[test]
    fn a_probe_without_a_verdict_changes_nothing_r_cap_1() {
        let no_verdict = ProbeResult::NoVerdict(HealthFailureCode::Timeout);
        let mut t = tracker(&["new", "down", "ok"]);
        // Never answered: stays unknown (not available), asked again soon.
        probe(&mut t, Instant::ZERO, "new", no_verdict);
        let s = t.provider_snapshot(&pid("new")).unwrap();
        assert_eq!((s.state, s.next_probe_at), (HealthState::Unknown, at(1)));
        assert!(!t.is_available(&pid("new")));
        // Failing: the streak neither grows nor ends; the backoff holds.
        probe(
            &mut t,
            Instant::ZERO,
            "down",
            fail(HealthFailureCode::Http5xx),
        );
        probe(&mut t, at(1), "down", fail(HealthFailureCode::Http5xx));
        probe(&mut t, at(3), "down", no_verdict);
        let s = t.provider_snapshot(&pid("down")).unwrap();
        assert_eq!(
            (
                s.state,
                s.consecutive_failures,
                s.failure_code,
                s.next_probe_at
            ),
            (
                HealthState::Unavailable,
                2,
                Some(HealthFailureCode::Http5xx),
                at(5)
            )
        );
        assert_eq!(
            events(&mut t),
            vec![
                ("down".to_owned(), HealthLifecycle::Detected),
                ("down".to_owned(), HealthLifecycle::Ongoing)
            ],
            "no lifecycle event for a probe without a verdict"
        );
        // ok: stays ok at its regular cadence; goes stale only when no
        // verdict came within stale_after (R-HT-5).
        let mut t = tracker(&["ok"]);
        probe(&mut t, Instant::ZERO, "ok", ProbeResult::Success);
        probe(&mut t, at(30), "ok", no_verdict);
        let s = t.provider_snapshot(&pid("ok")).unwrap();
        assert_eq!(
            (s.state, s.consecutive_failures, s.failures_total),
            (HealthState::Ok, 0, 0)
        );
        assert_eq!((s.next_probe_at, s.no_verdicts_total), (at(60), 1));
        assert!(t.is_available(&pid("ok")));
        probe(&mut t, at(60), "ok", no_verdict);
        assert!(take_probe(&mut t, at(89), "ok").is_none());
        t.handle_timeout(at(90));
        assert_eq!(t.state(&pid("ok")), Some(HealthState::Stale));
    }

    #[test]
    fn a_deployment_profile_cannot_go_stale_between_its_probes_r_ht_5() {
        assert_eq!(config().validate_deployment(), Ok(()));
        let flapping = HealthConfig {
            stale_after: 40 * SECOND,
            ..config()
        };
        assert_eq!(flapping.validate(), Ok(()), "a test profile may");
        assert_eq!(
            flapping.validate_deployment(),
            Err(HealthTrackerError::StaleBeforeNextProbe)
        );
        let zero = HealthConfig {
            probe_timeout: Duration::ZERO,
            ..config()
        };
        assert_eq!(
            zero.validate_deployment(),
            Err(HealthTrackerError::ZeroDuration("probe_timeout"))
        );
    }

    #[test]
    fn new_tracker_reports_detected_again() {
        let mut t = tracker(&["a"]);
        probe(&mut t, Instant::ZERO, "a", fail(HealthFailureCode::Http5xx));
        probe(&mut t, at(1), "a", fail(HealthFailureCode::Http5xx));
        assert_eq!(events(&mut t).len(), 2);
        // A process restart: state is process-local.
        let mut restarted = tracker(&["a"]);
        assert_eq!(restarted.state(&pid("a")), Some(HealthState::Unknown));
        probe(&mut restarted, at(2), "a", fail(HealthFailureCode::Http5xx));
        assert_eq!(
            events(&mut restarted),
            vec![("a".to_owned(), HealthLifecycle::Detected)]
        );
    }

    #[test]
    fn unavailable_and_stale_are_never_available() {
        let mut t = tracker(&["unknown", "down", "gone"]);
        // Unknown and unfollowed providers fail closed.
        assert!(!t.is_available(&pid("unknown")));
        assert!(!t.is_available(&pid("not-followed")));
        probe(
            &mut t,
            Instant::ZERO,
            "down",
            fail(HealthFailureCode::AuthenticationFailed),
        );
        assert!(!t.is_available(&pid("down")));
        // Stale because its node disconnected.
        probe(&mut t, Instant::ZERO, "gone", ProbeResult::Success);
        assert!(t.is_available(&pid("gone")));
        assert!(t.mark_stale(at(1), &pid("gone")));
        assert_eq!(t.state(&pid("gone")), Some(HealthState::Stale));
        assert!(!t.is_available(&pid("gone")));
        // An unavailable provider stays unavailable (and keeps its backoff)
        // when its node disconnects.
        assert!(!t.mark_stale(at(1), &pid("down")));
        assert_eq!(t.state(&pid("down")), Some(HealthState::Unavailable));
        // Stale is not an outage: the next success makes it ok silently.
        probe(&mut t, at(30), "gone", ProbeResult::Success);
        assert!(t.is_available(&pid("gone")));
        // `unknown` never answered its first probe: that timed out, which
        // is an outage, not availability.
        assert_eq!(t.state(&pid("unknown")), Some(HealthState::Unavailable));
        assert!(!t.is_available(&pid("unknown")));
        assert_eq!(
            events(&mut t),
            vec![
                ("down".to_owned(), HealthLifecycle::Detected),
                ("unknown".to_owned(), HealthLifecycle::Detected),
            ]
        );

        // Stale by age: no success for `stale_after` (refresh slower than that).
        let mut aging = harness(
            HealthConfig {
                refresh_interval: 100 * SECOND,
                ..config()
            },
            &["a"],
        );
        probe(&mut aging, Instant::ZERO, "a", ProbeResult::Success);
        assert_eq!(aging.poll_timeout(), Some(at(90)));
        aging.handle_timeout(at(89));
        assert!(aging.is_available(&pid("a")));
        aging.handle_timeout(at(90));
        assert_eq!(aging.state(&pid("a")), Some(HealthState::Stale));
        assert!(!aging.is_available(&pid("a")));
    }

    #[test]
    fn going_stale_by_time_is_reported_as_a_state_change_without_an_event() {
        // R-HT-5: ok -> stale by age has no lifecycle event; the change is
        // still reported so the owner can take the provider out of
        // selection. Refresh is slower than `stale_after` here.
        let mut t = harness(
            HealthConfig {
                refresh_interval: 100 * SECOND,
                ..config()
            },
            &["a", "b"],
        );
        probe(&mut t, Instant::ZERO, "a", ProbeResult::Success);
        probe(&mut t, at(5), "b", ProbeResult::Success);
        let drained: Vec<ProviderId> = std::iter::from_fn(|| t.poll_state_change()).collect();
        assert_eq!(
            drained,
            vec![pid("a"), pid("b")],
            "unknown -> ok, each once"
        );
        t.handle_timeout(at(89));
        assert_eq!(t.poll_state_change(), None, "nothing changed yet");
        t.handle_timeout(at(90));
        assert_eq!(t.state(&pid("a")), Some(HealthState::Stale));
        assert_eq!(t.poll_event(), None, "no lifecycle event for stale");
        assert_eq!(t.poll_state_change(), Some(pid("a")));
        assert_eq!(t.poll_state_change(), None, "only a went stale");
        // Repeated timers report nothing new.
        t.handle_timeout(at(91));
        assert_eq!(t.poll_state_change(), None);
        t.handle_timeout(at(95));
        assert_eq!(t.poll_state_change(), Some(pid("b")));
        // A disconnect's stale is reported too, once.
        let mut gone = tracker(&["g"]);
        probe(&mut gone, Instant::ZERO, "g", ProbeResult::Success);
        while gone.poll_state_change().is_some() {}
        assert!(gone.mark_stale(at(1), &pid("g")));
        assert!(!gone.mark_stale(at(1), &pid("g")));
        assert_eq!(gone.poll_state_change(), Some(pid("g")));
        assert_eq!(gone.poll_state_change(), None);
    }

    #[test]
    fn suspended_provider_is_not_probed_and_resumes_with_a_probe_at_once() {
        let mut tracker = HealthTracker::new(HealthConfig::default()).unwrap();
        let p = ProviderId::from("p");
        tracker.add_provider(Instant::ZERO, p.clone()).unwrap();
        let t = tracker.poll_probe(Instant::ZERO).unwrap();
        let _ = tracker.probe_result(Instant::ZERO, &t, ProbeResult::Success);
        assert!(tracker.suspend(Instant::from_millis(10), &p));
        assert_eq!(tracker.state(&p), Some(HealthState::Stale));
        let later = Instant::from_millis(120_000);
        tracker.handle_timeout(later);
        assert!(
            tracker.poll_probe(later).is_none(),
            "no probe while suspended"
        );
        assert!(tracker.resume(later, &p));
        assert!(
            tracker.poll_probe(later).is_some(),
            "a probe at once on resume"
        );
    }

    #[test]
    fn a_refresh_brings_forward_only_a_later_probe() {
        let mut t = tracker(&["a"]);
        // The first probe is due at once: nothing to bring forward.
        assert!(!t.request_refresh(Instant::ZERO, &pid("a")));
        let ticket = take_probe(&mut t, Instant::ZERO, "a").expect("due");
        assert!(!t.request_refresh(at(1), &pid("a")), "one in flight");
        let _ = t.probe_result(at(1), &ticket, ProbeResult::Success);
        assert!(
            t.request_refresh(at(2), &pid("a")),
            "the next refresh was later"
        );
        assert!(!t.request_refresh(at(2), &pid("a")), "already due now");
        assert!(!t.request_refresh(at(2), &pid("zz")), "not followed");
    }

    #[test]
    fn a_suspended_provider_asks_for_no_timer() {
        let mut t = tracker(&["a"]);
        let ticket = take_probe(&mut t, Instant::ZERO, "a").expect("due");
        let _ = t.probe_result(Instant::ZERO, &ticket, ProbeResult::Success);
        assert!(
            t.poll_timeout().is_some(),
            "refresh and ageing are scheduled"
        );
        assert!(t.suspend(at(1), &pid("a")));
        assert_eq!(t.poll_timeout(), None, "nothing to do until resume");
        assert!(t.resume(at(2), &pid("a")));
        assert_eq!(t.poll_timeout(), Some(at(2)), "a probe at once");
    }

    #[test]
    fn labels_config_and_removal_are_what_was_given() {
        // R-OBS-1: closed label values.
        let states = [
            HealthState::Unknown,
            HealthState::Ok,
            HealthState::Unavailable,
            HealthState::Stale,
        ]
        .map(HealthState::as_str);
        assert_eq!(states, ["unknown", "ok", "unavailable", "stale"]);
        let lifecycles = [
            HealthLifecycle::Detected,
            HealthLifecycle::Ongoing,
            HealthLifecycle::Recovered,
        ]
        .map(HealthLifecycle::as_str);
        assert_eq!(lifecycles, ["detected", "ongoing", "recovered"]);
        // A backoff base equal to its cap is valid (held at once).
        let flat = HealthConfig {
            backoff_base: 4 * SECOND,
            backoff_cap: 4 * SECOND,
            ..config()
        };
        assert_eq!(flat.validate(), Ok(()));
        let mut t = harness(flat, &["a"]);
        assert_eq!(t.config(), &flat);
        assert!(t.remove_provider(&pid("a")));
        assert!(!t.remove_provider(&pid("a")), "not followed any more");
    }

    #[test]
    fn late_answer_of_a_timed_out_probe_is_ignored() {
        let mut t = tracker(&["a"]);
        let ticket = take_probe(&mut t, Instant::ZERO, "a").expect("due");
        t.handle_timeout(at(10));
        assert_eq!(t.state(&pid("a")), Some(HealthState::Unavailable));
        assert_eq!(
            t.probe_result(at(11), &ticket, ProbeResult::Success),
            ProbeDisposition::Stale
        );
        assert_eq!(t.state(&pid("a")), Some(HealthState::Unavailable));
        assert!(t.remove_provider(&pid("a")));
        assert_eq!(
            t.probe_result(at(11), &ticket, ProbeResult::Success),
            ProbeDisposition::Stale
        );
    }

    const PROVIDERS: [&str; 3] = ["a", "b", "c"];

    #[derive(Debug, Clone)]
    enum Op {
        Advance(u64),
        Timeout,
        PollProbes,
        Answer {
            provider: usize,
            result: Option<HealthFailureCode>,
        },
        MarkStale(usize),
        Refresh(usize),
        /// The probe of this provider ends without a verdict (R-CAP-1).
        NoVerdict(usize),
    }

    fn code() -> impl Strategy<Value = HealthFailureCode> {
        proptest::sample::select(HealthFailureCode::ALL.to_vec())
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..40_000).prop_map(Op::Advance),
            2 => Just(Op::Timeout),
            4 => Just(Op::PollProbes),
            8 => (0..PROVIDERS.len(), proptest::option::weighted(0.6, code()))
                .prop_map(|(provider, result)| Op::Answer { provider, result }),
            1 => (0..PROVIDERS.len()).prop_map(Op::MarkStale),
            1 => (0..PROVIDERS.len()).prop_map(Op::Refresh),
            2 => (0..PROVIDERS.len()).prop_map(Op::NoVerdict),
        ]
    }

    /// The reference model of one provider's health, written from the
    /// rules (R-HT-1, R-HT-3, R-HT-5), not from the tracker: the last
    /// applied success, the failures since, whether it was marked or aged
    /// stale, and the probe in flight.
    #[derive(Debug, Clone, Default)]
    struct RefHealth {
        success_at: Option<Instant>,
        failures: u32,
        last_failure_at: Option<Instant>,
        stale: bool,
        in_flight: Option<Instant>,
    }

    impl RefHealth {
        fn state(&self) -> HealthState {
            if self.failures > 0 {
                HealthState::Unavailable
            } else if self.success_at.is_none() {
                HealthState::Unknown
            } else if self.stale {
                HealthState::Stale
            } else {
                HealthState::Ok
            }
        }

        fn fail(&mut self, now: Instant) {
            self.failures += 1;
            self.last_failure_at = Some(now);
        }
    }

    /// R-HT-3 backoff by repeated doubling from the base, held at the cap:
    /// a second statement of the rule, beside the tracker's shift.
    fn reference_backoff(base: Duration, cap: Duration, failures: u32) -> Duration {
        let mut backoff = base.min(cap);
        for _ in 1..failures {
            backoff = (backoff * 2).min(cap);
        }
        backoff
    }

    #[test]
    fn backoff_doubles_from_the_base_and_holds_at_the_cap() {
        let cfg = HealthConfig {
            backoff_cap: 4 * SECOND,
            ..config()
        };
        let expected_s = [1, 2, 4, 4, 4, 4];
        for (i, s) in expected_s.iter().enumerate() {
            let failures = i as u32 + 1;
            assert_eq!(cfg.backoff(failures), *s * SECOND, "{failures} failures");
            assert_eq!(reference_backoff(SECOND, 4 * SECOND, failures), *s * SECOND);
        }
        assert_eq!(cfg.backoff(u32::MAX), 4 * SECOND, "no overflow");
    }

    fn others(t: &HealthTracker, provider: usize) -> Vec<ProviderHealthSnapshot> {
        t.snapshot()
            .into_iter()
            .filter(|s| s.provider_id.as_str() != PROVIDERS[provider])
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

        #[test]
        fn health_invariants_hold_for_any_sequence(
            ops in proptest::collection::vec(op(), 0..60),
            stale_prone in any::<bool>(),
        ) {
            // A small cap, so long outages in a short sequence hold at it;
            // with `stale_prone`, an `ok` ages out before the next refresh
            // (R-HT-5 by time alone).
            let stale_after = if stale_prone { 15 * SECOND } else { config().stale_after };
            let cfg = HealthConfig { backoff_cap: 4 * SECOND, stale_after, ..config() };
            let mut t = harness(cfg, &PROVIDERS);
            let mut now = Instant::ZERO;
            let mut tickets: BTreeMap<String, ProbeTicket> = BTreeMap::new();
            let mut lifecycles: BTreeMap<String, Vec<HealthLifecycle>> = BTreeMap::new();
            let mut model: BTreeMap<String, RefHealth> =
                PROVIDERS.iter().map(|p| (p.to_string(), RefHealth::default())).collect();
            for op in ops {
                match op {
                    Op::Advance(ms) => now += Duration::from_millis(ms),
                    Op::Timeout => {
                        t.handle_timeout(now);
                        for r in model.values_mut() {
                            if r.in_flight.is_some_and(|at| at + cfg.probe_timeout <= now) {
                                r.in_flight = None;
                                r.fail(now);
                            }
                            if r.state() == HealthState::Ok
                                && r.success_at.is_some_and(|at| at + cfg.stale_after <= now)
                            {
                                r.stale = true;
                            }
                        }
                    }
                    Op::PollProbes => {
                        let before = t.snapshot();
                        while let Some(ticket) = t.poll_probe(now) {
                            let snap = before.iter().find(|s| s.provider_id == ticket.provider_id).expect("followed");
                            // Never before next_retry_at, never two in flight.
                            prop_assert!(snap.next_retry_at.is_none_or(|r| r <= now), "early probe {snap:?} at {now:?}");
                            prop_assert!(!snap.probe_in_flight);
                            prop_assert!(snap.next_probe_at <= now);
                            if let Some(r) = model.get_mut(&ticket.provider_id.0) {
                                r.in_flight = Some(now);
                            }
                            tickets.insert(ticket.provider_id.0.clone(), ticket);
                        }
                    }
                    Op::Answer { provider, result } => {
                        let others_before = others(&t, provider);
                        if let Some(ticket) = tickets.remove(PROVIDERS[provider]) {
                            let r = model.get_mut(PROVIDERS[provider]).expect("modelled");
                            let outcome = result.map_or(ProbeResult::Success, ProbeResult::Failure);
                            let disposition = t.probe_result(now, &ticket, outcome);
                            // A probe the timeout already failed is stale;
                            // one answered within its bound applies.
                            match r.in_flight {
                                None => prop_assert_eq!(disposition, ProbeDisposition::Stale),
                                Some(at) if now < at + cfg.probe_timeout => {
                                    prop_assert_eq!(disposition, ProbeDisposition::Applied);
                                }
                                Some(_) => {}
                            }
                            if disposition == ProbeDisposition::Applied {
                                r.in_flight = None;
                                match outcome {
                                    ProbeResult::Success => {
                                        r.success_at = Some(now);
                                        r.failures = 0;
                                        r.last_failure_at = None;
                                        r.stale = false;
                                    }
                                    ProbeResult::Failure(_) => r.fail(now),
                                    ProbeResult::NoVerdict(_) => {}
                                }
                            }
                        }
                        prop_assert_eq!(others(&t, provider), others_before, "isolation");
                    }
                    Op::NoVerdict(provider) => {
                        let others_before = others(&t, provider);
                        if let Some(ticket) = tickets.remove(PROVIDERS[provider]) {
                            let r = model.get_mut(PROVIDERS[provider]).expect("modelled");
                            let result = ProbeResult::NoVerdict(HealthFailureCode::Timeout);
                            if t.probe_result(now, &ticket, result) == ProbeDisposition::Applied {
                                // Nothing else changes (checked below
                                // against the model) but a failing
                                // provider's backoff, which starts again.
                                r.in_flight = None;
                                if r.failures > 0 {
                                    r.last_failure_at = Some(now);
                                }
                            }
                        }
                        prop_assert_eq!(others(&t, provider), others_before, "isolation");
                    }
                    Op::MarkStale(provider) => {
                        let others_before = others(&t, provider);
                        let marked = t.mark_stale(now, &pid(PROVIDERS[provider]));
                        let r = model.get_mut(PROVIDERS[provider]).expect("modelled");
                        prop_assert_eq!(marked, r.state() == HealthState::Ok, "only ok goes stale");
                        if marked {
                            r.stale = true;
                        }
                        prop_assert_eq!(others(&t, provider), others_before, "isolation");
                    }
                    Op::Refresh(provider) => {
                        let others_before = others(&t, provider);
                        let before = t.provider_snapshot(&pid(PROVIDERS[provider])).expect("followed");
                        let _ = t.request_refresh(now, &pid(PROVIDERS[provider]));
                        let after = t.provider_snapshot(&pid(PROVIDERS[provider])).expect("followed");
                        prop_assert_eq!(others(&t, provider), others_before, "isolation");
                        if before.consecutive_failures > 0 {
                            prop_assert_eq!(before, after, "refresh bypassed backoff");
                        }
                    }
                }
                while let Some(event) = t.poll_event() {
                    lifecycles.entry(event.provider_id.0.clone()).or_default().push(event.lifecycle);
                }
                for snap in t.snapshot() {
                    // Against the reference model: state, failures, the
                    // retry moment (failure + doubling backoff held at the
                    // cap) and availability (ok only: R-HT-5).
                    let r = &model[&snap.provider_id.0];
                    prop_assert_eq!(snap.state, r.state(), "{:?} vs {:?}", snap, r);
                    prop_assert_eq!(snap.consecutive_failures, r.failures);
                    let expected_retry = r.last_failure_at.filter(|_| r.failures > 0).map(|at| {
                        at + reference_backoff(cfg.backoff_base, cfg.backoff_cap, r.failures)
                    });
                    prop_assert_eq!(snap.next_retry_at, expected_retry, "{:?} vs {:?}", snap, r);
                    if let Some(retry_at) = expected_retry {
                        prop_assert_eq!(snap.next_probe_at, retry_at);
                    }
                    prop_assert_eq!(
                        t.is_available(&snap.provider_id),
                        r.state() == HealthState::Ok,
                        "{:?}",
                        r
                    );
                }
            }
            // Lifecycle: (detected ongoing? recovered)* with at most one open
            // outage at the end; never two alerts for one transition.
            for (provider, seq) in &lifecycles {
                let mut open: Option<HealthLifecycle> = None;
                for lifecycle in seq {
                    open = match (open, lifecycle) {
                        (None, HealthLifecycle::Detected) => Some(HealthLifecycle::Detected),
                        (Some(HealthLifecycle::Detected), HealthLifecycle::Ongoing) => Some(HealthLifecycle::Ongoing),
                        (Some(_), HealthLifecycle::Recovered) => None,
                        (state, event) => {
                            return Err(TestCaseError::fail(format!("{provider}: {event:?} after {state:?} in {seq:?}")));
                        }
                    };
                }
                let snap = t.provider_snapshot(&pid(provider)).expect("followed");
                prop_assert_eq!(open.is_some(), snap.consecutive_failures > 0);
            }
        }
    }
}
