//! The Node's stall watchdog: one coordinator for normalized runs and raw
//! provider tunnels (R-WD-1..8), sequencing its stall observations through
//! the connection's [`ObservationSequence`] (R-SEQ-1).
//!
//! ## Timeline of a stall
//!
//! ```text
//! start ── progress ── progress ──(no progress for stall_timeout)── claim ─┬─ fence: provider returns | close grace elapses ─┐
//!                                                                 (once)  └─ probe: result arrives  | probe bound elapses ──┴─ join ── one terminal
//! ```
//!
//! Only progress resets the stall timer (R-WD-1). The claim happens exactly
//! once: the provider call is canceled and, in parallel, a close-grace fence
//! and an exact-target health probe start (R-WD-2). The stall terminal is
//! emitted once both have joined or hit their bounds, so at the latest at
//! `claim + max(close_grace, probe_bound)` (R-WD-3). It is retryable only if
//! the provider call returned within the grace (R-WD-4) and carries
//! fail-closed health evidence from the probe (R-WD-5). After a claim or a
//! terminal, provider output is fenced and counted (R-WD-6). A hard deadline
//! or a disconnect wins over a stall, also during the join (R-WD-7). The
//! watchdog never retries and grants no recovery flag (R-WD-8).
//!
//! ## Driving it (the crate's driver loop, specialised)
//!
//! 1. Before any adapter call, turn the request's wire
//!    `response_stall_timeout_ms` into a duration with
//!    [`effective_stall_timeout`]; refuse an invalid one with
//!    [`InvalidStallTimeout::failure`] and never call the adapter.
//! 2. [`Watchdog::start`] the run or tunnel right before the provider call.
//! 3. For every provider output, classify it with
//!    [`ProviderEvent::from_run_event`] or [`ProviderEvent::from_tunnel_frame`]
//!    and report it with [`Watchdog::provider_event`] (or call
//!    [`Watchdog::progress`] / [`Watchdog::provider_returned`] directly).
//!    Forward a non-terminal output to the Edge only on
//!    [`Emission::Forward`]; drop it on [`Emission::Fenced`]. A returned
//!    provider call whose terminal was accepted also yields
//!    [`WatchdogOutput::Terminal`]: write the terminal when you drain that,
//!    never on your own.
//! 4. Drain [`Watchdog::poll_output`] until `None` and carry out each output
//!    in order (see [`WatchdogOutput`]). Report each probe's verdict with
//!    [`Watchdog::probe_result`].
//! 5. Arm a timer at [`Watchdog::poll_timeout`]; when it passes, call
//!    [`Watchdog::handle_timeout`] and go back to step 4. The timer may be
//!    earlier than strictly needed (deadlines are kept lazily, so progress
//!    stays cheap); an early wake-up is harmless.
//! 6. On disconnect call [`Watchdog::cancel_all`] with
//!    [`CancelReason::Disconnect`] (R-DISC-1); on `Cancel { run_id }` or a
//!    stream reset call [`Watchdog::cancel`] with [`CancelReason::Client`].
//!
//! Every input first applies the run's timers that are already due at its
//! `now`, so a late driver cannot let progress or a provider return slip in
//! after a stall or a deadline that had already happened.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use iop_wire::{
    DEFAULT_RESPONSE_STALL_TIMEOUT_MS, ExecutionFailure, FailureCode, HealthFailureCode,
    MAX_RESPONSE_STALL_TIMEOUT_MS, MIN_RESPONSE_STALL_TIMEOUT_MS, ProviderHealth,
    ProviderTunnelFrame, RunEventKind, StallMetadata,
};

use crate::ids::RunId;
use crate::node::session::ObservationSequence;
#[cfg(feature = "planted-bugs")]
use crate::planted::{Planted, PlantedBug};
use crate::time::{Instant, duration_ms};

/// Default close grace: how long a canceled provider call may take to return
/// and still earn the `retryable` hint (R-WD-4).
pub const DEFAULT_CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Default bound of the exact-target health probe started at a stall claim
/// (R-WD-2, R-WD-5).
pub const DEFAULT_PROBE_BOUND: Duration = Duration::from_secs(5);

/// Default limit of runs and tunnels one watchdog watches at once.
pub const DEFAULT_MAX_ACTIVE_RUNS: usize = 1024;

/// How many finished run ids a watchdog remembers, so late output for them
/// is fenced and counted as late (R-WD-6) and a reused id is refused.
pub const FINISHED_RUNS_REMEMBERED: usize = 1024;

/// Turn a request's wire `response_stall_timeout_ms` into the effective stall
/// timeout.
///
/// Wire `0` means [`DEFAULT_RESPONSE_STALL_TIMEOUT_MS`] (300000 ms). Any
/// other value outside
/// [`MIN_RESPONSE_STALL_TIMEOUT_MS`]`..=`[`MAX_RESPONSE_STALL_TIMEOUT_MS`] is
/// refused; the Node refuses it before any adapter is called (SPEC §3).
pub fn effective_stall_timeout(wire_ms: u64) -> Result<Duration, InvalidStallTimeout> {
    match wire_ms {
        0 => Ok(Duration::from_millis(DEFAULT_RESPONSE_STALL_TIMEOUT_MS)),
        MIN_RESPONSE_STALL_TIMEOUT_MS..=MAX_RESPONSE_STALL_TIMEOUT_MS => {
            Ok(Duration::from_millis(wire_ms))
        }
        _ => Err(InvalidStallTimeout {
            stall_timeout_ms: wire_ms,
        }),
    }
}

/// Turn a request's wire `deadline_ms` into the run's hard deadline from
/// receipt (R-WD-7: it wins over a stall that coincides with it): wire `0`
/// means none.
pub fn effective_deadline(wire_ms: u64) -> Option<Duration> {
    (wire_ms > 0).then(|| Duration::from_millis(wire_ms))
}

/// A request's `response_stall_timeout_ms` is out of range (the Edge is at
/// fault).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "response_stall_timeout_ms {stall_timeout_ms} is outside {min}..={max} (0 means the default)",
    min = MIN_RESPONSE_STALL_TIMEOUT_MS,
    max = MAX_RESPONSE_STALL_TIMEOUT_MS
)]
pub struct InvalidStallTimeout {
    /// The refused wire value.
    pub stall_timeout_ms: u64,
}

impl InvalidStallTimeout {
    /// The terminal failure the Node answers with (no adapter was called).
    pub fn failure(&self) -> ExecutionFailure {
        ExecutionFailure::new(FailureCode::InvalidRequest)
    }
}

/// Why [`Watchdog::start`] refused a run. The messages name no run id
/// (R-OBS-1); the fields carry it for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WatchdogError {
    /// The peer reused the id of a run that is still being watched.
    #[error("run id is already being watched on this connection")]
    DuplicateRun {
        /// The reused id.
        run_id: RunId,
    },
    /// The peer reused the id of a run that recently finished on this
    /// connection; its late output would be indistinguishable.
    #[error("run id already finished on this connection")]
    FinishedRun {
        /// The reused id.
        run_id: RunId,
    },
    /// The watchdog is at [`WatchdogConfig::max_active_runs`] (the driver
    /// admitted more work than configured).
    #[error("watchdog is at its limit of {max_active_runs} active runs")]
    TooManyRuns {
        /// The configured limit.
        max_active_runs: usize,
    },
}

impl WatchdogError {
    /// The failure code a refused run or tunnel is answered with;
    /// `carries_lease` says whether its request brought a sealed credential
    /// lease.
    ///
    /// A run id this connection is running or recently ran, arriving with a
    /// lease, is a replayed lease frame: it fails closed as
    /// `credential_rejected` (R-CRED-3), before any lease is opened or any
    /// provider called. (Past [`FINISHED_RUNS_REMEMBERED`] the lease's own
    /// single-use nonce still refuses it.) Without a lease a reused id is
    /// the Edge's invalid request, as is a run beyond the watchdog's limit.
    pub fn failure_code(&self, carries_lease: bool) -> FailureCode {
        match self {
            WatchdogError::DuplicateRun { .. } | WatchdogError::FinishedRun { .. }
                if carries_lease =>
            {
                FailureCode::CredentialRejected
            }
            WatchdogError::DuplicateRun { .. }
            | WatchdogError::FinishedRun { .. }
            | WatchdogError::TooManyRuns { .. } => FailureCode::InvalidRequest,
        }
    }
}

/// Watchdog settings that are the Node's own (the stall timeout travels per
/// request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WatchdogConfig {
    /// How long after a stall claim the canceled provider call may take to
    /// return and still earn `retryable` (R-WD-3, R-WD-4).
    pub close_grace: Duration,
    /// How long the exact-target health probe may take before its verdict is
    /// `unknown/health_unknown` (R-WD-3, R-WD-5).
    pub probe_bound: Duration,
    /// The most runs and tunnels watched at once.
    pub max_active_runs: usize,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            close_grace: DEFAULT_CLOSE_GRACE,
            probe_bound: DEFAULT_PROBE_BOUND,
            max_active_runs: DEFAULT_MAX_ACTIVE_RUNS,
        }
    }
}

/// What is being watched. One coordinator serves both (R-WD-1..8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// A normalized run (`RunRequest` -> `RunEvent`s).
    Normalized,
    /// A raw provider tunnel (`ProviderTunnelRequest` -> `ProviderTunnelFrame`s).
    Tunnel,
}

impl RunKind {
    /// The stable lower-case name (a closed metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            RunKind::Normalized => "normalized",
            RunKind::Tunnel => "tunnel",
        }
    }
}

/// Provider output that resets the stall timer (R-WD-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Progress {
    /// A non-empty piece of generated text.
    Content,
    /// A piece of a tool call.
    ToolCall,
    /// A tunnel's response status and headers.
    TunnelHead,
    /// Non-empty tunnel body bytes.
    TunnelBody,
    /// A non-terminal usage report.
    Usage,
}

/// How a provider call ended, as reported to [`Watchdog::provider_returned`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderOutcome {
    /// The provider's own normal end (`RunEventKind::Completed`,
    /// `ProviderTunnelFrame::End`); the driver keeps its payload and forwards
    /// it if the watchdog emits [`RunTerminal::Completed`].
    Completed,
    /// The provider call failed; the adapter's sanitized failure.
    Failed(ExecutionFailure),
}

/// One provider output, classified for the watchdog (R-WD-1).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderEvent {
    /// Output that resets the stall timer.
    Progress(Progress),
    /// Output that is forwarded if not fenced but is not progress
    /// (`Started`, an empty text delta, an empty body chunk).
    Neutral,
    /// The provider call ended. A terminal wins over any payload or usage it
    /// carries (R-WD-1).
    Returned(ProviderOutcome),
}

impl ProviderEvent {
    /// Classify a normalized run event (R-WD-1).
    pub fn from_run_event(kind: &RunEventKind) -> Self {
        match kind {
            RunEventKind::Started { .. } => ProviderEvent::Neutral,
            RunEventKind::TextDelta(text) if text.is_empty() => ProviderEvent::Neutral,
            RunEventKind::TextDelta(_) => ProviderEvent::Progress(Progress::Content),
            RunEventKind::ReasoningDelta(text) if text.is_empty() => ProviderEvent::Neutral,
            RunEventKind::ReasoningDelta(_)
            | RunEventKind::Embedding(_)
            | RunEventKind::Logprobs(_) => ProviderEvent::Progress(Progress::Content),
            RunEventKind::ToolCallDelta(_) => ProviderEvent::Progress(Progress::ToolCall),
            RunEventKind::Usage(_) => ProviderEvent::Progress(Progress::Usage),
            // A terminal wins over the usage it carries.
            RunEventKind::Completed { .. } => ProviderEvent::Returned(ProviderOutcome::Completed),
            RunEventKind::Failed(failure) => {
                ProviderEvent::Returned(ProviderOutcome::Failed(failure.clone()))
            }
        }
    }

    /// Classify a tunnel frame (R-WD-1).
    pub fn from_tunnel_frame(frame: &ProviderTunnelFrame) -> Self {
        match frame {
            ProviderTunnelFrame::Head { .. } => ProviderEvent::Progress(Progress::TunnelHead),
            ProviderTunnelFrame::Body(bytes) if bytes.is_empty() => ProviderEvent::Neutral,
            ProviderTunnelFrame::Body(_) => ProviderEvent::Progress(Progress::TunnelBody),
            ProviderTunnelFrame::End => ProviderEvent::Returned(ProviderOutcome::Completed),
            ProviderTunnelFrame::Failure(failure) => {
                ProviderEvent::Returned(ProviderOutcome::Failed(failure.clone()))
            }
        }
    }
}

/// The verdict of the exact-target health probe started at a stall claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeOutcome {
    /// The target answered healthy.
    Healthy,
    /// The target answered unhealthy, with the sanitized reason if known.
    Unhealthy(Option<HealthFailureCode>),
    /// The probe itself failed (an error is not a verdict).
    Failed,
}

/// Why a run is canceled from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelReason {
    /// The Edge sent `Cancel { run_id }` or reset the run's stream.
    Client,
    /// The connection carrying the run ended (R-DISC-1).
    Disconnect,
}

impl CancelReason {
    fn failure_code(self) -> FailureCode {
        match self {
            CancelReason::Client => FailureCode::Canceled,
            CancelReason::Disconnect => FailureCode::TransportClosed,
        }
    }
}

/// What the driver does with a provider output it just reported.
#[must_use = "fenced provider output must not reach the Edge (R-WD-6)"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Emission {
    /// Forward it to the Edge (for a returned call: a `Terminal` is queued).
    Forward,
    /// Drop it: the run's stall was claimed, its terminal was emitted, or the
    /// run is unknown (R-WD-6).
    Fenced,
}

/// The one terminal of a run or tunnel.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunTerminal {
    /// The provider's own normal end; the driver forwards its payload
    /// (`Completed { finish_reason, usage }` or the tunnel's `End`).
    Completed,
    /// A failure; the driver sends it as `RunEventKind::Failed` or
    /// `ProviderTunnelFrame::Failure`.
    Failed(ExecutionFailure),
}

/// Work for the driver, drained with [`Watchdog::poll_output`] and carried
/// out in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchdogOutput {
    /// Stop the provider HTTP call now (drop it, which closes the request);
    /// report that it ended with [`Watchdog::provider_returned`] (R-WD-2,
    /// R-WD-4).
    CancelProvider {
        /// The run.
        run_id: RunId,
    },
    /// Begin the exact-target health probe for this run's adapter/target,
    /// bounded by [`WatchdogConfig::probe_bound`], and report its verdict
    /// with [`Watchdog::probe_result`] (R-WD-2, R-WD-5).
    StartProbe {
        /// The run.
        run_id: RunId,
    },
    /// Send this run's one terminal to the Edge; nothing more is ever sent
    /// for the run (R-WD-3, R-WD-6). A probe still running for it may be
    /// abandoned.
    Terminal {
        /// The run.
        run_id: RunId,
        /// What to send.
        terminal: RunTerminal,
    },
    /// A stall terminal is being emitted (it follows immediately): record
    /// `iop_node_response_stalls_total`,
    /// `iop_node_response_stall_duration_seconds` and the
    /// `node_response_stall_observation` log. Every field is a closed value
    /// or a duration, except `run_id`, which must not become a label.
    StallObserved {
        /// The run (for correlation only, never a label).
        run_id: RunId,
        /// Normalized run or tunnel.
        kind: RunKind,
        /// Time since the last progress when the stall was claimed.
        elapsed_ms: u64,
        /// The probe's evidence (R-WD-5).
        health: ProviderHealth,
        /// Why the probe found the target unhealthy or gave no verdict, if
        /// known (`timeout` when the probe bound elapsed).
        probe_failure: Option<HealthFailureCode>,
        /// Whether the provider call returned within the close grace (R-WD-4).
        retryable: bool,
    },
}

/// Where a stalled run's close-grace fence stands (R-WD-3, R-WD-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fence {
    /// The canceled provider call has not returned and the grace runs.
    Open,
    /// The call returned before the grace elapsed: retryable.
    ReturnedWithinGrace,
    /// The grace elapsed first: not retryable.
    GraceElapsed,
}

/// Where a stalled run's health probe stands (R-WD-3, R-WD-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// No verdict yet and the bound runs.
    Pending,
    /// Joined: a verdict arrived or the bound elapsed.
    Done {
        health: ProviderHealth,
        failure: Option<HealthFailureCode>,
    },
}

/// The join of a claimed stall.
#[derive(Debug, Clone, Copy)]
struct StallJoin {
    /// Time since the last progress at the claim.
    elapsed: Duration,
    /// The fence closes (not retryable) at this moment.
    grace_until: Instant,
    /// The probe times out at this moment.
    probe_until: Instant,
    fence: Fence,
    probe: Probe,
}

/// One watched run or tunnel.
#[derive(Debug, Clone)]
struct Run {
    kind: RunKind,
    stall_timeout: Duration,
    deadline: Option<Instant>,
    /// Start, or the latest progress; the stall moment is derived from it
    /// lazily, so progress is a single store.
    last_progress: Instant,
    /// `Some` once the stall was claimed (at most once, R-WD-2).
    stall: Option<StallJoin>,
    /// This run's entry in [`Watchdog::wakeups`]; never later than
    /// [`Run::next_wakeup`].
    armed: Option<Instant>,
}

impl Run {
    /// The earliest moment one of this run's timers is due.
    fn next_wakeup(&self) -> Instant {
        let own = match &self.stall {
            None => self.last_progress + self.stall_timeout,
            Some(join) => {
                let mut next = Instant::MAX;
                if join.fence == Fence::Open {
                    next = next.min(join.grace_until);
                }
                if join.probe == Probe::Pending {
                    next = next.min(join.probe_until);
                }
                next
            }
        };
        self.deadline.map_or(own, |deadline| own.min(deadline))
    }
}

/// The stall watchdog of one connection: every normalized run and raw tunnel
/// on it, one coordinator (R-WD-1..8, R-SEQ-1).
///
/// Progress is `O(log n)` in the number of watched runs and allocates
/// nothing; timers are kept lazily in one ordered set with one entry per run.
#[derive(Debug)]
pub struct Watchdog {
    config: WatchdogConfig,
    /// The connection's observation sequence; `None` on an unbound path.
    sequence: Option<ObservationSequence>,
    runs: BTreeMap<RunId, Run>,
    /// One `(moment, run)` entry per watched run, at or before its next due
    /// timer.
    wakeups: BTreeSet<(Instant, RunId)>,
    /// Recently finished runs, oldest first, at most
    /// [`FINISHED_RUNS_REMEMBERED`].
    finished_order: VecDeque<RunId>,
    finished: BTreeSet<RunId>,
    outputs: VecDeque<WatchdogOutput>,
    fenced_late_outputs: u64,
    unknown_run_outputs: u64,
    #[cfg(feature = "planted-bugs")]
    planted: Planted,
}

impl Watchdog {
    /// A watchdog for one connection.
    ///
    /// `sequence` is the connection Session's observation sequence; pass
    /// `None` on a path with no bound connection, and stall terminals omit
    /// `health_observation_seq` (R-SEQ-1).
    pub fn new(config: WatchdogConfig, sequence: Option<ObservationSequence>) -> Self {
        Self {
            config,
            sequence,
            runs: BTreeMap::new(),
            wakeups: BTreeSet::new(),
            finished_order: VecDeque::new(),
            finished: BTreeSet::new(),
            outputs: VecDeque::new(),
            fenced_late_outputs: 0,
            unknown_run_outputs: 0,
            #[cfg(feature = "planted-bugs")]
            planted: Planted::default(),
        }
    }

    /// Switch a planted bug on (test-only; see [`crate::planted`]). Takes
    /// `&self`: the simulator holds its watchdogs inside recording wrappers
    /// that give read access only.
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&self, bug: PlantedBug) {
        self.planted.plant(bug);
    }

    /// Planted `SecondTerminal`: a provider call that returns after its
    /// run's terminal gets a terminal of its own instead of being fenced.
    #[cfg(feature = "planted-bugs")]
    fn planted_late_return(&mut self, run_id: RunId, outcome: &ProviderOutcome) -> bool {
        if !self.planted.has(PlantedBug::SecondTerminal) || !self.finished.contains(&run_id) {
            return false;
        }
        let terminal = match outcome {
            ProviderOutcome::Completed => RunTerminal::Completed,
            ProviderOutcome::Failed(failure) => {
                RunTerminal::Failed(sanitize_provider_failure(failure.clone()))
            }
        };
        self.outputs
            .push_back(WatchdogOutput::Terminal { run_id, terminal });
        true
    }

    /// The settings this watchdog runs with.
    pub fn config(&self) -> &WatchdogConfig {
        &self.config
    }

    /// Start watching a run or tunnel whose provider call begins now.
    ///
    /// `stall_timeout` is the effective stall timeout (see
    /// [`effective_stall_timeout`]); `deadline` the run's hard deadline, if
    /// any. A run id that is being watched or recently finished is refused,
    /// as is a run beyond [`WatchdogConfig::max_active_runs`].
    pub fn start(
        &mut self,
        now: Instant,
        run_id: RunId,
        kind: RunKind,
        stall_timeout: Duration,
        deadline: Option<Instant>,
    ) -> Result<(), WatchdogError> {
        if self.runs.contains_key(&run_id) {
            return Err(WatchdogError::DuplicateRun { run_id });
        }
        if self.finished.contains(&run_id) {
            return Err(WatchdogError::FinishedRun { run_id });
        }
        if self.runs.len() >= self.config.max_active_runs {
            return Err(WatchdogError::TooManyRuns {
                max_active_runs: self.config.max_active_runs,
            });
        }
        let mut run = Run {
            kind,
            stall_timeout,
            deadline,
            last_progress: now,
            stall: None,
            armed: None,
        };
        let wakeup = run.next_wakeup();
        run.armed = Some(wakeup);
        self.wakeups.insert((wakeup, run_id));
        self.runs.insert(run_id, run);
        Ok(())
    }

    /// Report a provider output, classified by
    /// [`ProviderEvent::from_run_event`] or
    /// [`ProviderEvent::from_tunnel_frame`].
    pub fn provider_event(
        &mut self,
        now: Instant,
        run_id: RunId,
        event: ProviderEvent,
    ) -> Emission {
        match event {
            ProviderEvent::Progress(progress) => self.progress(now, run_id, progress),
            ProviderEvent::Neutral => self.neutral(now, run_id),
            ProviderEvent::Returned(outcome) => self.provider_returned(now, run_id, outcome),
        }
    }

    /// Report progress (R-WD-1): it resets the run's stall timer and is
    /// forwarded, unless the run's stall was claimed or its terminal emitted,
    /// in which case it is fenced and counted (R-WD-6).
    pub fn progress(&mut self, now: Instant, run_id: RunId, progress: Progress) -> Emission {
        // Every kind of progress counts the same for the timer (R-WD-1).
        let _ = progress;
        self.fire_due(now, run_id);
        match self.runs.get_mut(&run_id) {
            Some(run) if run.stall.is_none() => {
                // Lazy: the stall moment moves later, the armed wake-up stays
                // at or before it.
                run.last_progress = run.last_progress.max(now);
                Emission::Forward
            }
            _ => self.fence(run_id),
        }
    }

    /// Report provider output that is not progress (`Started`, an empty
    /// delta): forwarded unless fenced, and it never resets the stall timer
    /// (R-WD-1).
    pub fn neutral(&mut self, now: Instant, run_id: RunId) -> Emission {
        self.fire_due(now, run_id);
        match self.runs.get(&run_id) {
            Some(run) if run.stall.is_none() => Emission::Forward,
            _ => self.fence(run_id),
        }
    }

    /// Report that the provider call ended, normally or with a failure.
    ///
    /// Before a stall claim, the outcome becomes the run's terminal
    /// ([`WatchdogOutput::Terminal`] is queued) and this returns
    /// [`Emission::Forward`]. A provider failure passes with `retryable`
    /// cleared and any stall evidence stripped: only the watchdog claims
    /// stalls and grants the retry hint (R-WD-2, R-WD-4, R-WD-8).
    ///
    /// After a claim, this only records whether the call returned within
    /// the close grace (R-WD-4); the output is fenced and counted (R-WD-6).
    pub fn provider_returned(
        &mut self,
        now: Instant,
        run_id: RunId,
        outcome: ProviderOutcome,
    ) -> Emission {
        self.fire_due(now, run_id);
        #[cfg(feature = "planted-bugs")]
        if !self.runs.contains_key(&run_id) && self.planted_late_return(run_id, &outcome) {
            return Emission::Forward;
        }
        let Some(run) = self.runs.get_mut(&run_id) else {
            return self.fence(run_id);
        };
        match &mut run.stall {
            None => {
                let terminal = match outcome {
                    ProviderOutcome::Completed => RunTerminal::Completed,
                    ProviderOutcome::Failed(failure) => {
                        RunTerminal::Failed(sanitize_provider_failure(failure))
                    }
                };
                // The call already ended: nothing to cancel.
                self.finish(run_id, false, terminal);
                Emission::Forward
            }
            Some(join) => {
                // `fire_due` closed the fence if the grace had elapsed, so an
                // open fence here means the call returned within it (R-WD-4).
                if join.fence == Fence::Open {
                    join.fence = Fence::ReturnedWithinGrace;
                }
                let emission = self.fence(run_id);
                self.try_join(run_id);
                emission
            }
        }
    }

    /// Report the verdict of the health probe started by
    /// [`WatchdogOutput::StartProbe`] (R-WD-5).
    ///
    /// A verdict is never progress, never lifts the fence and never grants
    /// retry. A verdict after the probe bound, after the terminal, or for a
    /// run without a claimed stall is ignored.
    pub fn probe_result(&mut self, now: Instant, run_id: RunId, outcome: ProbeOutcome) {
        self.fire_due(now, run_id);
        let Some(join) = self
            .runs
            .get_mut(&run_id)
            .and_then(|run| run.stall.as_mut())
        else {
            return;
        };
        if join.probe != Probe::Pending {
            return;
        }
        join.probe = match outcome {
            ProbeOutcome::Healthy => Probe::Done {
                health: ProviderHealth::Available,
                failure: None,
            },
            ProbeOutcome::Unhealthy(failure) => Probe::Done {
                health: ProviderHealth::Unavailable,
                failure,
            },
            // Fail closed: an error is not evidence either way.
            ProbeOutcome::Failed => Probe::Done {
                health: ProviderHealth::Unknown,
                failure: None,
            },
        };
        self.try_join(run_id);
    }

    /// Cancel one run: `Client` ends it with `canceled`, `Disconnect` with
    /// `transport_closed`. A cancel wins over a stall that is due or being
    /// joined (R-WD-7); a hard deadline that already passed wins over the
    /// cancel. Unknown or finished runs are ignored.
    pub fn cancel(&mut self, now: Instant, run_id: RunId, reason: CancelReason) {
        let Some(run) = self.runs.get(&run_id) else {
            return;
        };
        // A claimed stall already canceled the provider call.
        let cancel_provider = run.stall.is_none();
        let code = if run.deadline.is_some_and(|deadline| deadline <= now) {
            FailureCode::DeadlineExceeded
        } else {
            reason.failure_code()
        };
        self.finish(
            run_id,
            cancel_provider,
            RunTerminal::Failed(ExecutionFailure::new(code)),
        );
    }

    /// Cancel every watched run, in run id order (R-DISC-1).
    pub fn cancel_all(&mut self, now: Instant, reason: CancelReason) {
        let run_ids: Vec<RunId> = self.runs.keys().copied().collect();
        for run_id in run_ids {
            self.cancel(now, run_id, reason);
        }
    }

    /// Fire every timer due at `now`: hard deadlines, stall claims, close
    /// graces and probe bounds. Calling it early is harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        // Each run has one wake-up and `fire_due` re-arms it strictly after
        // `now`, so one pass visits each run at most once: bound the loop by
        // that.
        for _ in 0..self.wakeups.len() {
            let Some(&(wakeup, run_id)) = self.wakeups.first() else {
                break;
            };
            if wakeup > now {
                break;
            }
            self.wakeups.remove(&(wakeup, run_id));
            if let Some(run) = self.runs.get_mut(&run_id) {
                run.armed = None;
            }
            self.fire_due(now, run_id);
            debug_assert!(
                self.runs
                    .get(&run_id)
                    .and_then(|run| run.armed)
                    .is_none_or(|armed| armed > now),
                "a fired run is re-armed after now"
            );
        }
    }

    /// The moment [`handle_timeout`](Self::handle_timeout) should next be
    /// called, `None` with nothing watched. It may be earlier than strictly
    /// needed, never later.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.wakeups.first().map(|&(wakeup, _)| wakeup)
    }

    /// The next output to carry out. Call after every input and timeout
    /// until it returns `None`.
    #[must_use = "outputs that are not carried out are lost"]
    pub fn poll_output(&mut self) -> Option<WatchdogOutput> {
        self.outputs.pop_front()
    }

    /// Take the connection's next observation sequence value for a
    /// `Capabilities` answer (R-SEQ-1, R-CAP-1); `None` on an unbound path.
    #[must_use = "a taken sequence value belongs on the observation being finalized"]
    pub fn take_observation_seq(&mut self) -> Option<u64> {
        self.sequence.as_mut().map(ObservationSequence::take)
    }

    /// The next observation sequence value, not consumed
    /// (`TransportStatusReport`); `None` on an unbound path.
    pub fn next_observation_seq(&self) -> Option<u64> {
        self.sequence.as_ref().map(ObservationSequence::peek_next)
    }

    /// Provider outputs fenced because their run's stall was claimed or its
    /// terminal emitted (R-WD-6).
    pub fn fenced_late_outputs(&self) -> u64 {
        self.fenced_late_outputs
    }

    /// Provider outputs fenced because their run id was never watched or
    /// was forgotten (a driver bug if it grows).
    pub fn unknown_run_outputs(&self) -> u64 {
        self.unknown_run_outputs
    }

    /// Runs and tunnels being watched, including stalls being joined.
    pub fn active_runs(&self) -> usize {
        self.runs.len()
    }

    /// Whether this run is being watched (it has no terminal yet).
    pub fn is_active(&self, run_id: RunId) -> bool {
        self.runs.contains_key(&run_id)
    }

    /// Apply the run's timers that are due at `now`, in rule order, then
    /// re-arm its wake-up.
    fn fire_due(&mut self, now: Instant, run_id: RunId) {
        let Some(run) = self.runs.get_mut(&run_id) else {
            return;
        };
        // The armed wake-up is never later than the run's next timer.
        if run.armed.is_some_and(|armed| now < armed) {
            return;
        }
        // R-WD-7: a hard deadline wins over a coincident stall and over a
        // stall being joined.
        if run.deadline.is_some_and(|deadline| deadline <= now) {
            let cancel_provider = run.stall.is_none();
            self.finish(
                run_id,
                cancel_provider,
                RunTerminal::Failed(ExecutionFailure::new(FailureCode::DeadlineExceeded)),
            );
            return;
        }
        let claimable = run.last_progress + run.stall_timeout;
        if run.stall.is_none() && claimable <= now {
            // R-WD-2: claim once; cancel the provider, then start the fence
            // and the probe in parallel.
            run.stall = Some(StallJoin {
                elapsed: now - run.last_progress,
                grace_until: now + self.config.close_grace,
                probe_until: now + self.config.probe_bound,
                fence: Fence::Open,
                probe: Probe::Pending,
            });
            self.outputs
                .push_back(WatchdogOutput::CancelProvider { run_id });
            self.outputs
                .push_back(WatchdogOutput::StartProbe { run_id });
        }
        if let Some(join) = &mut run.stall {
            if join.fence == Fence::Open && join.grace_until <= now {
                join.fence = Fence::GraceElapsed;
            }
            if join.probe == Probe::Pending && join.probe_until <= now {
                // R-WD-5: a probe that timed out is no evidence.
                join.probe = Probe::Done {
                    health: ProviderHealth::Unknown,
                    failure: Some(HealthFailureCode::Timeout),
                };
            }
        }
        self.rearm(run_id);
        self.try_join(run_id);
    }

    /// Move the run's wake-up to its next due timer.
    fn rearm(&mut self, run_id: RunId) {
        let Some(run) = self.runs.get_mut(&run_id) else {
            return;
        };
        let next = run.next_wakeup();
        if let Some(armed) = run.armed.replace(next) {
            self.wakeups.remove(&(armed, run_id));
        }
        self.wakeups.insert((next, run_id));
    }

    /// Emit the stall terminal once both the fence and the probe joined
    /// (R-WD-3).
    fn try_join(&mut self, run_id: RunId) {
        let Some(run) = self.runs.get(&run_id) else {
            return;
        };
        let Some(join) = run.stall else {
            return;
        };
        let Probe::Done { health, failure } = join.probe else {
            return;
        };
        if join.fence == Fence::Open {
            return;
        }
        // R-WD-4: only a call that returned within the grace is retryable.
        let retryable = join.fence == Fence::ReturnedWithinGrace;
        let elapsed_ms = duration_ms(join.elapsed);
        let stall_failure = ExecutionFailure {
            code: FailureCode::ResponseStalled,
            retryable,
            provider_health: Some(health),
            liveness_classification: Some(health.liveness_classification()),
            // R-SEQ-1: taken when the observation is finalized.
            health_observation_seq: self.sequence.as_mut().map(ObservationSequence::take),
            stall: Some(StallMetadata {
                elapsed_ms,
                stall_timeout_ms: duration_ms(run.stall_timeout),
            }),
            http_status: None,
            health_failure: Some(HealthFailureCode::ResponseStalled),
            provider_message: None,
        };
        self.outputs.push_back(WatchdogOutput::StallObserved {
            run_id,
            kind: run.kind,
            elapsed_ms,
            health,
            probe_failure: failure,
            retryable,
        });
        // The claim already canceled the provider call.
        self.finish(run_id, false, RunTerminal::Failed(stall_failure));
    }

    /// Emit the run's one terminal and forget the run (R-WD-6).
    fn finish(&mut self, run_id: RunId, cancel_provider: bool, terminal: RunTerminal) {
        let Some(run) = self.runs.remove(&run_id) else {
            return;
        };
        if let Some(armed) = run.armed {
            self.wakeups.remove(&(armed, run_id));
        }
        if cancel_provider {
            self.outputs
                .push_back(WatchdogOutput::CancelProvider { run_id });
        }
        self.outputs
            .push_back(WatchdogOutput::Terminal { run_id, terminal });
        if self.finished_order.len() >= FINISHED_RUNS_REMEMBERED
            && let Some(forgotten) = self.finished_order.pop_front()
        {
            self.finished.remove(&forgotten);
        }
        self.finished_order.push_back(run_id);
        self.finished.insert(run_id);
    }

    /// Fence one provider output and count it (R-WD-6).
    fn fence(&mut self, run_id: RunId) -> Emission {
        if self.runs.contains_key(&run_id) || self.finished.contains(&run_id) {
            self.fenced_late_outputs = self.fenced_late_outputs.saturating_add(1);
        } else {
            self.unknown_run_outputs = self.unknown_run_outputs.saturating_add(1);
        }
        Emission::Fenced
    }
}

/// A provider's own failure as the node forwards it, before any stall
/// claim: it carries no stall
/// evidence the Node did not observe itself (R-WD-2, R-WD-5, R-SEQ-1). The
/// provider call has ended, so it is `retryable` exactly when another
/// provider may answer it (R-FAIL-1, R-WD-4); the Node itself never
/// retries (R-WD-8).
pub fn sanitize_provider_failure(mut failure: ExecutionFailure) -> ExecutionFailure {
    if failure.code == FailureCode::ResponseStalled {
        // Only the watchdog claims stalls (R-WD-2).
        failure.code = FailureCode::ProviderError;
    }
    failure.retryable = crate::retry::class_may_fail_over(failure.code, failure.http_status);
    failure.provider_health = None;
    failure.liveness_classification = None;
    failure.health_observation_seq = None;
    failure.stall = None;
    failure
}

#[cfg(test)]
mod tests {
    use super::*;
    use iop_wire::{FinishReason, LivenessClassification, Usage};

    const STALL: Duration = Duration::from_secs(1);

    fn ms(millis: u64) -> Instant {
        Instant::from_millis(millis)
    }

    fn config() -> WatchdogConfig {
        WatchdogConfig {
            close_grace: Duration::from_secs(2),
            probe_bound: Duration::from_secs(5),
            max_active_runs: 16,
        }
    }

    fn bound() -> Watchdog {
        Watchdog::new(config(), Some(ObservationSequence::new()))
    }

    fn drain(wd: &mut Watchdog) -> Vec<WatchdogOutput> {
        std::iter::from_fn(|| wd.poll_output()).collect()
    }

    fn cancel_provider(run_id: RunId) -> WatchdogOutput {
        WatchdogOutput::CancelProvider { run_id }
    }

    fn start_probe(run_id: RunId) -> WatchdogOutput {
        WatchdogOutput::StartProbe { run_id }
    }

    fn failed(run_id: RunId, code: FailureCode) -> WatchdogOutput {
        WatchdogOutput::Terminal {
            run_id,
            terminal: RunTerminal::Failed(ExecutionFailure::new(code)),
        }
    }

    /// The stall failure among `outputs`, checking it is preceded by its
    /// `StallObserved` and that it is the last output for its run.
    fn stall_terminal(outputs: &[WatchdogOutput]) -> ExecutionFailure {
        let position = outputs
            .iter()
            .position(|output| {
                matches!(
                    output,
                    WatchdogOutput::Terminal {
                        terminal: RunTerminal::Failed(ExecutionFailure {
                            code: FailureCode::ResponseStalled,
                            ..
                        }),
                        ..
                    }
                )
            })
            .expect("a stall terminal");
        assert!(position > 0, "StallObserved precedes the stall terminal");
        assert!(matches!(
            outputs[position - 1],
            WatchdogOutput::StallObserved { .. }
        ));
        match &outputs[position] {
            WatchdogOutput::Terminal {
                terminal: RunTerminal::Failed(failure),
                ..
            } => failure.clone(),
            _ => unreachable!(),
        }
    }

    /// Start run 1 at 0 ms and let it stall at 1000 ms.
    fn stalled(mut wd: Watchdog) -> Watchdog {
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
        wd
    }

    #[test]
    fn progress_resets_the_stall_timer() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        assert_eq!(wd.poll_timeout(), Some(ms(1000)));
        assert_eq!(
            wd.progress(ms(900), 1, Progress::Content),
            Emission::Forward
        );
        // The wake-up is lazy: the early one is harmless and re-arms later.
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![]);
        assert_eq!(wd.poll_timeout(), Some(ms(1900)));
        assert_eq!(
            wd.progress(ms(1500), 1, Progress::ToolCall),
            Emission::Forward
        );
        wd.handle_timeout(ms(1900));
        assert_eq!(drain(&mut wd), vec![]);
        wd.handle_timeout(ms(2499));
        assert_eq!(drain(&mut wd), vec![]);
        wd.handle_timeout(ms(2500));
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
    }

    #[test]
    fn every_kind_of_progress_resets_the_timer_of_runs_and_tunnels() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.start(ms(0), 2, RunKind::Tunnel, STALL, None)
            .expect("start");
        let mut now = 0;
        for progress in [Progress::Content, Progress::ToolCall, Progress::Usage] {
            now += 900;
            assert_eq!(wd.progress(ms(now), 1, progress), Emission::Forward);
            assert_eq!(
                wd.progress(ms(now), 2, Progress::TunnelBody),
                Emission::Forward
            );
            wd.handle_timeout(ms(now));
        }
        now += 900;
        assert_eq!(
            wd.progress(ms(now), 2, Progress::TunnelHead),
            Emission::Forward
        );
        wd.handle_timeout(ms(now));
        assert_eq!(drain(&mut wd), vec![]);
        // Run 1 last progressed at 2700 ms, the tunnel at 3600 ms.
        wd.handle_timeout(ms(3700));
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
        wd.handle_timeout(ms(4600));
        assert_eq!(drain(&mut wd), vec![cancel_provider(2), start_probe(2)]);
    }

    #[test]
    fn started_and_empty_output_are_not_progress() {
        assert_eq!(
            ProviderEvent::from_run_event(&RunEventKind::Started {
                session_id: "s".into()
            }),
            ProviderEvent::Neutral
        );
        assert_eq!(
            ProviderEvent::from_run_event(&RunEventKind::TextDelta(String::new())),
            ProviderEvent::Neutral
        );
        assert_eq!(
            ProviderEvent::from_tunnel_frame(&ProviderTunnelFrame::Body(Vec::new())),
            ProviderEvent::Neutral
        );
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        assert_eq!(wd.neutral(ms(500), 1), Emission::Forward);
        assert_eq!(
            wd.provider_event(ms(900), 1, ProviderEvent::Neutral),
            Emission::Forward
        );
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
        assert_eq!(wd.neutral(ms(1100), 1), Emission::Fenced);
    }

    #[test]
    fn text_and_tool_call_deltas_are_progress() {
        // R-WD-1: content resets the stall timer; only an empty delta is
        // neutral.
        assert_eq!(
            ProviderEvent::from_run_event(&RunEventKind::TextDelta("hi".into())),
            ProviderEvent::Progress(Progress::Content)
        );
        assert_eq!(
            ProviderEvent::from_run_event(&RunEventKind::TextDelta(" ".into())),
            ProviderEvent::Progress(Progress::Content)
        );
    }

    #[test]
    fn usage_is_progress_but_terminal_wins() {
        let usage = Usage::tokens(3, 5);
        let completed = RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage),
        };
        assert_eq!(
            ProviderEvent::from_run_event(&RunEventKind::Usage(usage)),
            ProviderEvent::Progress(Progress::Usage)
        );
        assert_eq!(
            ProviderEvent::from_run_event(&completed),
            ProviderEvent::Returned(ProviderOutcome::Completed)
        );

        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        let usage_event = ProviderEvent::from_run_event(&RunEventKind::Usage(usage));
        assert_eq!(
            wd.provider_event(ms(900), 1, usage_event),
            Emission::Forward
        );
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![], "usage reset the timer");
        // The terminal carrying usage ends the run; it is not progress.
        let terminal_event = ProviderEvent::from_run_event(&completed);
        assert_eq!(
            wd.provider_event(ms(1800), 1, terminal_event),
            Emission::Forward
        );
        assert_eq!(
            drain(&mut wd),
            vec![WatchdogOutput::Terminal {
                run_id: 1,
                terminal: RunTerminal::Completed
            }]
        );
        assert_eq!(wd.active_runs(), 0);
        assert_eq!(wd.poll_timeout(), None);

        // After a claim the same terminal-with-usage neither resets nor ends
        // the run: it is fenced, and the stall terminal follows.
        let mut wd = stalled(bound());
        let terminal_event = ProviderEvent::from_run_event(&completed);
        assert_eq!(
            wd.provider_event(ms(1100), 1, terminal_event),
            Emission::Fenced
        );
        assert_eq!(drain(&mut wd), vec![]);
        wd.probe_result(ms(1200), 1, ProbeOutcome::Healthy);
        let failure = stall_terminal(&drain(&mut wd));
        assert!(failure.retryable, "the call returned within the grace");
    }

    #[test]
    fn tunnel_frames_are_classified_head_and_body_as_progress_end_as_terminal() {
        let head = ProviderTunnelFrame::Head {
            status: 200,
            headers: vec![],
        };
        assert_eq!(
            ProviderEvent::from_tunnel_frame(&head),
            ProviderEvent::Progress(Progress::TunnelHead)
        );
        assert_eq!(
            ProviderEvent::from_tunnel_frame(&ProviderTunnelFrame::Body(b"data: {}".to_vec())),
            ProviderEvent::Progress(Progress::TunnelBody)
        );
        assert_eq!(
            ProviderEvent::from_tunnel_frame(&ProviderTunnelFrame::End),
            ProviderEvent::Returned(ProviderOutcome::Completed)
        );
        let failure = ExecutionFailure::new(FailureCode::ProviderError);
        assert_eq!(
            ProviderEvent::from_tunnel_frame(&ProviderTunnelFrame::Failure(failure.clone())),
            ProviderEvent::Returned(ProviderOutcome::Failed(failure))
        );
    }

    #[test]
    fn stall_is_claimed_once_and_cancels_provider_then_starts_probe() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.handle_timeout(ms(999));
        assert_eq!(drain(&mut wd), vec![]);
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
        // No second claim, whatever happens before the join.
        assert_eq!(
            wd.progress(ms(1200), 1, Progress::Content),
            Emission::Fenced
        );
        for now in [1000, 1500, 2000, 2999] {
            wd.handle_timeout(ms(now));
            assert_eq!(drain(&mut wd), vec![]);
        }
        assert!(wd.is_active(1));
    }

    #[test]
    fn a_late_driver_cannot_slip_progress_in_after_the_stall_moment() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        // The timer at 1000 ms was not fired; progress at 1500 ms is too late.
        assert_eq!(
            wd.progress(ms(1500), 1, Progress::Content),
            Emission::Fenced
        );
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
        wd.probe_result(ms(1600), 1, ProbeOutcome::Healthy);
        wd.handle_timeout(ms(3500));
        let failure = stall_terminal(&drain(&mut wd));
        assert_eq!(
            failure.stall,
            Some(StallMetadata {
                elapsed_ms: 1500,
                stall_timeout_ms: 1000
            })
        );
    }

    #[test]
    fn terminal_waits_for_both_grace_and_probe_then_emits_once() {
        // Probe first, then the provider returns.
        let mut wd = stalled(bound());
        wd.probe_result(ms(1500), 1, ProbeOutcome::Healthy);
        assert_eq!(drain(&mut wd), vec![], "the fence is still open");
        assert_eq!(
            wd.provider_returned(ms(2000), 1, ProviderOutcome::Completed),
            Emission::Fenced
        );
        let outputs = drain(&mut wd);
        assert_eq!(outputs.len(), 2);
        let _ = stall_terminal(&outputs);
        for now in [3000, 6000, 60_000] {
            wd.handle_timeout(ms(now));
            assert_eq!(drain(&mut wd), vec![]);
        }
        assert_eq!(wd.poll_timeout(), None);

        // The provider returns first, then the probe answers.
        let mut wd = stalled(bound());
        assert_eq!(
            wd.provider_returned(
                ms(1100),
                1,
                ProviderOutcome::Failed(ExecutionFailure::new(FailureCode::Canceled))
            ),
            Emission::Fenced
        );
        assert_eq!(drain(&mut wd), vec![], "the probe is still running");
        wd.handle_timeout(ms(3000));
        assert_eq!(drain(&mut wd), vec![]);
        wd.probe_result(ms(4000), 1, ProbeOutcome::Healthy);
        let outputs = drain(&mut wd);
        assert_eq!(outputs.len(), 2);
        let _ = stall_terminal(&outputs);
        wd.probe_result(ms(4001), 1, ProbeOutcome::Failed);
        wd.handle_timeout(ms(60_000));
        assert_eq!(drain(&mut wd), vec![]);
    }

    #[test]
    fn latest_emission_is_claim_plus_max_of_grace_and_probe_not_sum() {
        // Grace 2 s < probe bound 5 s: nothing joins, the claim is at 1 s.
        let mut wd = stalled(bound());
        assert_eq!(wd.poll_timeout(), Some(ms(3000)));
        wd.handle_timeout(ms(3000));
        assert_eq!(drain(&mut wd), vec![], "grace elapsed, probe still bounded");
        assert_eq!(wd.poll_timeout(), Some(ms(6000)));
        wd.handle_timeout(ms(5999));
        assert_eq!(drain(&mut wd), vec![]);
        wd.handle_timeout(ms(6000));
        let _ = stall_terminal(&drain(&mut wd));

        // Grace 5 s > probe bound 2 s.
        let swapped = WatchdogConfig {
            close_grace: Duration::from_secs(5),
            probe_bound: Duration::from_secs(2),
            ..config()
        };
        let mut wd = stalled(Watchdog::new(swapped, Some(ObservationSequence::new())));
        assert_eq!(wd.poll_timeout(), Some(ms(3000)));
        wd.handle_timeout(ms(3000));
        assert_eq!(drain(&mut wd), vec![]);
        assert_eq!(wd.poll_timeout(), Some(ms(6000)));
        wd.handle_timeout(ms(6000));
        let failure = stall_terminal(&drain(&mut wd));
        assert_eq!(failure.provider_health, Some(ProviderHealth::Unknown));
        assert!(!failure.retryable);
    }

    #[test]
    fn provider_returning_within_grace_is_retryable() {
        let mut wd = stalled(bound());
        assert_eq!(
            wd.provider_returned(ms(2999), 1, ProviderOutcome::Completed),
            Emission::Fenced
        );
        wd.probe_result(ms(3500), 1, ProbeOutcome::Healthy);
        assert!(stall_terminal(&drain(&mut wd)).retryable);
    }

    #[test]
    fn provider_returning_after_grace_is_not_retryable() {
        // Returning exactly when the grace elapses is already too late.
        let mut wd = stalled(bound());
        wd.probe_result(ms(1500), 1, ProbeOutcome::Healthy);
        assert_eq!(
            wd.provider_returned(ms(3000), 1, ProviderOutcome::Completed),
            Emission::Fenced
        );
        assert!(!stall_terminal(&drain(&mut wd)).retryable);

        // Returning after the grace, while the probe still runs.
        let mut wd = stalled(bound());
        wd.handle_timeout(ms(3000));
        assert_eq!(
            wd.provider_returned(ms(3500), 1, ProviderOutcome::Completed),
            Emission::Fenced
        );
        wd.probe_result(ms(4000), 1, ProbeOutcome::Healthy);
        assert!(!stall_terminal(&drain(&mut wd)).retryable);

        // Never returning at all.
        let mut wd = stalled(bound());
        wd.probe_result(ms(1500), 1, ProbeOutcome::Healthy);
        wd.handle_timeout(ms(3000));
        assert!(!stall_terminal(&drain(&mut wd)).retryable);
    }

    /// Stall run 1, have the provider return within the grace and the probe
    /// report `outcome` (or stay silent), and return the stall failure.
    fn stall_with_probe(outcome: Option<ProbeOutcome>) -> (ExecutionFailure, WatchdogOutput) {
        let mut wd = stalled(bound());
        let _ = wd.provider_returned(ms(1100), 1, ProviderOutcome::Completed);
        match outcome {
            Some(outcome) => wd.probe_result(ms(1200), 1, outcome),
            None => wd.handle_timeout(ms(6000)),
        }
        let outputs = drain(&mut wd);
        let failure = stall_terminal(&outputs);
        (failure, outputs[0].clone())
    }

    #[test]
    fn probe_healthy_is_available_request_stalled() {
        let (failure, observed) = stall_with_probe(Some(ProbeOutcome::Healthy));
        assert_eq!(failure.provider_health, Some(ProviderHealth::Available));
        assert_eq!(
            failure.liveness_classification,
            Some(LivenessClassification::RequestStalled)
        );
        assert!(matches!(
            observed,
            WatchdogOutput::StallObserved {
                health: ProviderHealth::Available,
                probe_failure: None,
                ..
            }
        ));
    }

    #[test]
    fn probe_unhealthy_is_unavailable_provider_unhealthy() {
        let outcome = ProbeOutcome::Unhealthy(Some(HealthFailureCode::Http5xx));
        let (failure, observed) = stall_with_probe(Some(outcome));
        assert_eq!(failure.provider_health, Some(ProviderHealth::Unavailable));
        assert_eq!(
            failure.liveness_classification,
            Some(LivenessClassification::ProviderUnhealthy)
        );
        // The stall's own class stays `response_stalled`; the probe's reason
        // goes to the observation.
        assert_eq!(
            failure.health_failure,
            Some(HealthFailureCode::ResponseStalled)
        );
        assert!(matches!(
            observed,
            WatchdogOutput::StallObserved {
                health: ProviderHealth::Unavailable,
                probe_failure: Some(HealthFailureCode::Http5xx),
                ..
            }
        ));
    }

    #[test]
    fn probe_error_is_unknown_health_unknown() {
        let (failure, _) = stall_with_probe(Some(ProbeOutcome::Failed));
        assert_eq!(failure.provider_health, Some(ProviderHealth::Unknown));
        assert_eq!(
            failure.liveness_classification,
            Some(LivenessClassification::HealthUnknown)
        );
    }

    #[test]
    fn probe_timeout_is_unknown_health_unknown() {
        let (failure, observed) = stall_with_probe(None);
        assert_eq!(failure.provider_health, Some(ProviderHealth::Unknown));
        assert_eq!(
            failure.liveness_classification,
            Some(LivenessClassification::HealthUnknown)
        );
        assert!(matches!(
            observed,
            WatchdogOutput::StallObserved {
                probe_failure: Some(HealthFailureCode::Timeout),
                ..
            }
        ));
        // A verdict arriving exactly at the bound is too late.
        let mut wd = stalled(bound());
        let _ = wd.provider_returned(ms(1100), 1, ProviderOutcome::Completed);
        wd.probe_result(ms(6000), 1, ProbeOutcome::Healthy);
        let failure = stall_terminal(&drain(&mut wd));
        assert_eq!(failure.provider_health, Some(ProviderHealth::Unknown));
    }

    #[test]
    fn probe_success_is_not_progress() {
        let mut wd = stalled(bound());
        wd.probe_result(ms(1100), 1, ProbeOutcome::Healthy);
        // Not a terminal: the fence did not lift.
        assert_eq!(drain(&mut wd), vec![]);
        // Not progress: output stays fenced, no new claim.
        assert_eq!(
            wd.progress(ms(1200), 1, Progress::Content),
            Emission::Fenced
        );
        wd.probe_result(ms(1300), 1, ProbeOutcome::Healthy);
        assert_eq!(drain(&mut wd), vec![]);
        // No retry: the grace elapses without the call returning.
        wd.handle_timeout(ms(3000));
        let failure = stall_terminal(&drain(&mut wd));
        assert!(!failure.retryable);
        assert_eq!(failure.provider_health, Some(ProviderHealth::Available));

        // A verdict before any claim changes nothing either.
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Tunnel, STALL, None)
            .expect("start");
        wd.probe_result(ms(900), 1, ProbeOutcome::Healthy);
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
    }

    #[test]
    fn late_output_after_terminal_is_fenced_and_counted() {
        let mut wd = stalled(bound());
        assert_eq!(
            wd.progress(ms(1100), 1, Progress::Content),
            Emission::Fenced
        );
        assert_eq!(wd.fenced_late_outputs(), 1, "fenced after the claim");
        wd.probe_result(ms(1200), 1, ProbeOutcome::Healthy);
        wd.handle_timeout(ms(3000));
        let _ = stall_terminal(&drain(&mut wd));

        assert_eq!(
            wd.progress(ms(3100), 1, Progress::Content),
            Emission::Fenced
        );
        assert_eq!(wd.neutral(ms(3100), 1), Emission::Fenced);
        assert_eq!(
            wd.provider_returned(ms(3200), 1, ProviderOutcome::Completed),
            Emission::Fenced
        );
        wd.probe_result(ms(3300), 1, ProbeOutcome::Unhealthy(None));
        wd.cancel(ms(3300), 1, CancelReason::Client);
        wd.handle_timeout(ms(100_000));
        assert_eq!(drain(&mut wd), vec![], "never a second terminal");
        assert_eq!(wd.fenced_late_outputs(), 4);
        assert_eq!(wd.unknown_run_outputs(), 0);

        // Output for a run never watched is fenced too, counted apart.
        assert_eq!(
            wd.progress(ms(3400), 77, Progress::Content),
            Emission::Fenced
        );
        assert_eq!(wd.unknown_run_outputs(), 1);
        assert_eq!(wd.fenced_late_outputs(), 4);
    }

    #[test]
    fn provider_failure_before_a_stall_is_forwarded_without_evidence_and_retryable_by_class() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Tunnel, STALL, None)
            .expect("start");
        let forged = ExecutionFailure {
            code: FailureCode::ResponseStalled,
            retryable: true,
            provider_health: Some(ProviderHealth::Unavailable),
            liveness_classification: Some(LivenessClassification::ProviderUnhealthy),
            health_observation_seq: Some(99),
            stall: Some(StallMetadata {
                elapsed_ms: 1,
                stall_timeout_ms: 1,
            }),
            http_status: Some(503),
            health_failure: Some(HealthFailureCode::Http5xx),
            provider_message: None,
        };
        assert_eq!(
            wd.provider_returned(ms(500), 1, ProviderOutcome::Failed(forged)),
            Emission::Forward
        );
        // Stripped of forged stall evidence; retryable because the call
        // ended with a 5xx another provider may answer (R-FAIL-1).
        let expected = ExecutionFailure {
            retryable: true,
            http_status: Some(503),
            health_failure: Some(HealthFailureCode::Http5xx),
            ..ExecutionFailure::new(FailureCode::ProviderError)
        };
        assert_eq!(
            drain(&mut wd),
            vec![WatchdogOutput::Terminal {
                run_id: 1,
                terminal: RunTerminal::Failed(expected)
            }]
        );
        assert_eq!(wd.next_observation_seq(), Some(1), "no observation taken");
    }

    #[test]
    fn deadline_wins_over_coincident_stall() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, Some(ms(1000)))
            .expect("start");
        wd.handle_timeout(ms(1000));
        assert_eq!(
            drain(&mut wd),
            vec![cancel_provider(1), failed(1, FailureCode::DeadlineExceeded)]
        );
        assert_eq!(wd.next_observation_seq(), Some(1));
        assert_eq!(wd.poll_timeout(), None);

        // Also when the driver only notices through a late input.
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, Some(ms(1000)))
            .expect("start");
        assert_eq!(
            wd.progress(ms(1200), 1, Progress::Content),
            Emission::Fenced
        );
        assert_eq!(
            drain(&mut wd),
            vec![cancel_provider(1), failed(1, FailureCode::DeadlineExceeded)]
        );
    }

    #[test]
    fn deadline_wins_over_stall_during_join() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Tunnel, STALL, Some(ms(2500)))
            .expect("start");
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![cancel_provider(1), start_probe(1)]);
        wd.probe_result(ms(1500), 1, ProbeOutcome::Healthy);
        assert_eq!(wd.poll_timeout(), Some(ms(2500)));
        wd.handle_timeout(ms(2500));
        // The provider was already canceled at the claim.
        assert_eq!(
            drain(&mut wd),
            vec![failed(1, FailureCode::DeadlineExceeded)]
        );
        assert_eq!(wd.next_observation_seq(), Some(1));
        assert_eq!(
            wd.provider_returned(ms(2600), 1, ProviderOutcome::Completed),
            Emission::Fenced
        );
        wd.handle_timeout(ms(100_000));
        assert_eq!(drain(&mut wd), vec![]);

        // A deadline that coincides with the join itself still wins.
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Tunnel, STALL, Some(ms(3000)))
            .expect("start");
        wd.handle_timeout(ms(1000));
        let _ = drain(&mut wd);
        wd.probe_result(ms(1500), 1, ProbeOutcome::Healthy);
        wd.handle_timeout(ms(3000));
        assert_eq!(
            drain(&mut wd),
            vec![failed(1, FailureCode::DeadlineExceeded)]
        );
    }

    #[test]
    fn disconnect_wins_over_stall_during_join() {
        let mut wd = stalled(bound());
        wd.probe_result(ms(1200), 1, ProbeOutcome::Unhealthy(None));
        wd.cancel(ms(1500), 1, CancelReason::Disconnect);
        assert_eq!(
            drain(&mut wd),
            vec![failed(1, FailureCode::TransportClosed)]
        );
        assert_eq!(wd.next_observation_seq(), Some(1));
        assert_eq!(
            wd.provider_returned(ms(1600), 1, ProviderOutcome::Completed),
            Emission::Fenced
        );
        wd.handle_timeout(ms(100_000));
        assert_eq!(drain(&mut wd), vec![]);
    }

    #[test]
    fn disconnect_wins_over_coincident_stall() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        // The stall is due at 1000 ms but was not fired yet: no claim, no probe.
        wd.cancel_all(ms(1000), CancelReason::Disconnect);
        assert_eq!(
            drain(&mut wd),
            vec![cancel_provider(1), failed(1, FailureCode::TransportClosed)]
        );
    }

    #[test]
    fn client_cancel_ends_the_run_with_canceled() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.start(ms(0), 2, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.cancel(ms(300), 1, CancelReason::Client);
        assert_eq!(
            drain(&mut wd),
            vec![cancel_provider(1), failed(1, FailureCode::Canceled)]
        );
        // Only that run.
        assert!(wd.is_active(2));
        wd.cancel(ms(400), 1, CancelReason::Client);
        wd.cancel(ms(400), 42, CancelReason::Client);
        assert_eq!(drain(&mut wd), vec![]);
    }

    #[test]
    fn cancel_all_on_disconnect_ends_every_run_once() {
        let mut wd = bound();
        wd.start(ms(0), 3, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.start(ms(500), 1, RunKind::Tunnel, STALL, None)
            .expect("start");
        wd.start(ms(600), 2, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.handle_timeout(ms(1000));
        assert_eq!(drain(&mut wd), vec![cancel_provider(3), start_probe(3)]);
        wd.cancel_all(ms(1200), CancelReason::Disconnect);
        assert_eq!(
            drain(&mut wd),
            vec![
                cancel_provider(1),
                failed(1, FailureCode::TransportClosed),
                cancel_provider(2),
                failed(2, FailureCode::TransportClosed),
                failed(3, FailureCode::TransportClosed),
            ]
        );
        assert_eq!(wd.active_runs(), 0);
        assert_eq!(wd.poll_timeout(), None);
        wd.cancel_all(ms(1300), CancelReason::Disconnect);
        wd.probe_result(ms(1300), 3, ProbeOutcome::Healthy);
        wd.handle_timeout(ms(100_000));
        assert_eq!(drain(&mut wd), vec![]);
    }

    #[test]
    fn observation_seq_is_unique_and_increasing_across_runs_and_tunnels() {
        let mut wd = bound();
        assert_eq!(wd.next_observation_seq(), Some(1));
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.start(ms(0), 2, RunKind::Tunnel, STALL, None)
            .expect("start");
        wd.handle_timeout(ms(1000));
        let _ = drain(&mut wd);
        // The claim took nothing; finalization takes, in finalization order.
        assert_eq!(wd.next_observation_seq(), Some(1));
        wd.probe_result(ms(1100), 2, ProbeOutcome::Healthy);
        let _ = wd.provider_returned(ms(1100), 2, ProviderOutcome::Completed);
        let tunnel = stall_terminal(&drain(&mut wd));
        // A Capabilities answer in between shares the sequence.
        assert_eq!(wd.take_observation_seq(), Some(2));
        wd.probe_result(ms(1200), 1, ProbeOutcome::Failed);
        let _ = wd.provider_returned(ms(1200), 1, ProviderOutcome::Completed);
        let normalized = stall_terminal(&drain(&mut wd));
        assert_eq!(tunnel.health_observation_seq, Some(1));
        assert_eq!(normalized.health_observation_seq, Some(3));
        assert_eq!(wd.next_observation_seq(), Some(4));
    }

    #[test]
    fn unbound_watchdog_omits_observation_seq() {
        let mut wd = stalled(Watchdog::new(config(), None));
        assert_eq!(wd.next_observation_seq(), None);
        assert_eq!(wd.take_observation_seq(), None);
        wd.handle_timeout(ms(6000));
        let failure = stall_terminal(&drain(&mut wd));
        assert_eq!(failure.health_observation_seq, None);
        assert_eq!(failure.code, FailureCode::ResponseStalled);
    }

    #[test]
    fn stall_terminal_carries_typed_safe_metadata() {
        let mut wd = stalled(bound());
        let _ = wd.provider_returned(ms(1500), 1, ProviderOutcome::Completed);
        wd.probe_result(ms(2000), 1, ProbeOutcome::Healthy);
        let outputs = drain(&mut wd);
        assert_eq!(
            outputs,
            vec![
                WatchdogOutput::StallObserved {
                    run_id: 1,
                    kind: RunKind::Normalized,
                    elapsed_ms: 1000,
                    health: ProviderHealth::Available,
                    probe_failure: None,
                    retryable: true,
                },
                WatchdogOutput::Terminal {
                    run_id: 1,
                    terminal: RunTerminal::Failed(ExecutionFailure {
                        code: FailureCode::ResponseStalled,
                        retryable: true,
                        provider_health: Some(ProviderHealth::Available),
                        liveness_classification: Some(LivenessClassification::RequestStalled),
                        health_observation_seq: Some(1),
                        stall: Some(StallMetadata {
                            elapsed_ms: 1000,
                            stall_timeout_ms: 1000,
                        }),
                        http_status: None,
                        health_failure: Some(HealthFailureCode::ResponseStalled),
                        provider_message: None,
                    }),
                },
            ]
        );
    }

    #[test]
    fn zero_deadline_means_none_r_wd_7() {
        assert_eq!(effective_deadline(0), None);
        assert_eq!(effective_deadline(1), Some(Duration::from_millis(1)));
        assert_eq!(
            effective_deadline(90_000),
            Some(Duration::from_millis(90_000))
        );
    }

    #[test]
    fn zero_stall_timeout_means_300000_ms() {
        assert_eq!(
            effective_stall_timeout(0),
            Ok(Duration::from_millis(300_000))
        );
        assert_eq!(
            effective_stall_timeout(0),
            Ok(Duration::from_millis(DEFAULT_RESPONSE_STALL_TIMEOUT_MS))
        );
    }

    #[test]
    fn out_of_range_stall_timeout_is_rejected() {
        for wire_ms in [
            1,
            MIN_RESPONSE_STALL_TIMEOUT_MS - 1,
            MAX_RESPONSE_STALL_TIMEOUT_MS + 1,
            u64::MAX,
        ] {
            let err = effective_stall_timeout(wire_ms).expect_err("out of range");
            assert_eq!(err.stall_timeout_ms, wire_ms);
            assert_eq!(
                err.failure(),
                ExecutionFailure::new(FailureCode::InvalidRequest)
            );
            assert!(err.to_string().contains("response_stall_timeout_ms"));
        }
        for wire_ms in [
            MIN_RESPONSE_STALL_TIMEOUT_MS,
            30_000,
            MAX_RESPONSE_STALL_TIMEOUT_MS,
        ] {
            assert_eq!(
                effective_stall_timeout(wire_ms),
                Ok(Duration::from_millis(wire_ms))
            );
        }
    }

    #[test]
    fn duplicate_and_recently_finished_run_ids_are_refused() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        assert_eq!(
            wd.start(ms(0), 1, RunKind::Tunnel, STALL, None),
            Err(WatchdogError::DuplicateRun { run_id: 1 })
        );
        wd.cancel(ms(10), 1, CancelReason::Client);
        let _ = drain(&mut wd);
        assert_eq!(
            wd.start(ms(20), 1, RunKind::Normalized, STALL, None),
            Err(WatchdogError::FinishedRun { run_id: 1 })
        );
        let err = WatchdogError::DuplicateRun { run_id: 12345 };
        assert!(!err.to_string().contains("12345"), "no run id in messages");
    }

    #[test]
    fn reused_run_id_with_a_lease_is_a_replay_answered_credential_rejected() {
        let mut wd = bound();
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        // R-CRED-3: the same lease frame again, while the run is watched...
        let running = wd
            .start(ms(1), 1, RunKind::Normalized, STALL, None)
            .expect_err("a reused run id");
        assert_eq!(running.failure_code(true), FailureCode::CredentialRejected);
        // ...and after it finished on this connection.
        let _ = wd.provider_returned(ms(2), 1, ProviderOutcome::Completed);
        let _ = drain(&mut wd);
        let finished = wd
            .start(ms(3), 1, RunKind::Tunnel, STALL, None)
            .expect_err("a reused run id");
        assert_eq!(finished, WatchdogError::FinishedRun { run_id: 1 });
        assert_eq!(finished.failure_code(true), FailureCode::CredentialRejected);
        assert_eq!(wd.active_runs(), 0, "the replay started nothing");
    }

    #[test]
    fn reused_run_id_without_a_lease_or_a_run_over_the_limit_is_invalid_request() {
        for error in [
            WatchdogError::DuplicateRun { run_id: 1 },
            WatchdogError::FinishedRun { run_id: 1 },
        ] {
            assert_eq!(error.failure_code(false), FailureCode::InvalidRequest);
        }
        // The limit is not about the lease: the same answer with or without.
        let full = WatchdogError::TooManyRuns { max_active_runs: 2 };
        assert_eq!(full.failure_code(false), FailureCode::InvalidRequest);
        assert_eq!(full.failure_code(true), FailureCode::InvalidRequest);
    }

    #[test]
    fn finished_run_memory_is_bounded() {
        let mut wd = Watchdog::new(config(), None);
        let total = RunId::try_from(FINISHED_RUNS_REMEMBERED).expect("fits") + 1;
        for run_id in 0..total {
            wd.start(ms(0), run_id, RunKind::Tunnel, STALL, None)
                .expect("start");
            let _ = wd.provider_returned(ms(1), run_id, ProviderOutcome::Completed);
        }
        let _ = drain(&mut wd);
        assert_eq!(wd.finished.len(), FINISHED_RUNS_REMEMBERED);
        assert_eq!(wd.finished_order.len(), FINISHED_RUNS_REMEMBERED);
        // The oldest is forgotten: its late output counts as unknown.
        assert_eq!(wd.progress(ms(2), 0, Progress::Content), Emission::Fenced);
        assert_eq!(wd.unknown_run_outputs(), 1);
        assert_eq!(wd.progress(ms(2), 1, Progress::Content), Emission::Fenced);
        assert_eq!(wd.fenced_late_outputs(), 1);
    }

    #[test]
    fn too_many_runs_is_refused_at_the_bound() {
        let limited = WatchdogConfig {
            max_active_runs: 2,
            ..config()
        };
        let mut wd = Watchdog::new(limited, None);
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.start(ms(0), 2, RunKind::Tunnel, STALL, None)
            .expect("start");
        assert_eq!(
            wd.start(ms(0), 3, RunKind::Normalized, STALL, None),
            Err(WatchdogError::TooManyRuns { max_active_runs: 2 })
        );
        wd.cancel(ms(1), 1, CancelReason::Client);
        wd.start(ms(1), 3, RunKind::Normalized, STALL, None)
            .expect("room again");
        assert_eq!(wd.active_runs(), 2);
    }

    #[test]
    fn default_config_is_two_second_grace_and_five_second_probe() {
        let config = WatchdogConfig::default();
        assert_eq!(config.close_grace, Duration::from_secs(2));
        assert_eq!(config.probe_bound, Duration::from_secs(5));
        assert_eq!(config.max_active_runs, DEFAULT_MAX_ACTIVE_RUNS);
        assert_eq!(RunKind::Tunnel.as_str(), "tunnel");
        assert_eq!(RunKind::Normalized.as_str(), "normalized");
    }

    #[test]
    fn zero_grace_and_zero_probe_bound_emit_at_the_claim() {
        let instant = WatchdogConfig {
            close_grace: Duration::ZERO,
            probe_bound: Duration::ZERO,
            ..config()
        };
        let mut wd = Watchdog::new(instant, Some(ObservationSequence::new()));
        wd.start(ms(0), 1, RunKind::Normalized, STALL, None)
            .expect("start");
        wd.handle_timeout(ms(1000));
        let outputs = drain(&mut wd);
        assert_eq!(outputs[..2], [cancel_provider(1), start_probe(1)]);
        let failure = stall_terminal(&outputs);
        assert!(!failure.retryable);
        assert_eq!(failure.provider_health, Some(ProviderHealth::Unknown));
    }

    /// A random driver against a reference model: after every step, every
    /// output is checked against what the rules allow.
    mod properties {
        use super::*;
        use proptest::collection::vec;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Start {
                run_id: RunId,
                tunnel: bool,
                stall_ms: u64,
                deadline_ms: Option<u64>,
            },
            Progress {
                pick: Pick,
            },
            Neutral {
                pick: Pick,
            },
            Return {
                pick: Pick,
                failed: bool,
            },
            Probe {
                pick: Pick,
                outcome: ProbeOutcome,
            },
            Cancel {
                pick: Pick,
                reason: CancelReason,
            },
            Disconnect,
            TakeSeq,
            Advance {
                ms: u64,
            },
            /// A late driver: the clock moves without firing timers (a
            /// punctual driver advances instead).
            Jump {
                ms: u64,
            },
        }

        /// Which run an input is for, resolved when it is applied, so most
        /// inputs reach a live run or a stall being joined.
        #[derive(Debug, Clone, Copy)]
        enum Pick {
            Live(usize),
            Claimed(usize),
            Any(RunId),
        }

        fn run_id() -> impl Strategy<Value = RunId> {
            0..10u64
        }

        fn pick() -> impl Strategy<Value = Pick> {
            prop_oneof![
                3 => any::<usize>().prop_map(Pick::Live),
                3 => any::<usize>().prop_map(Pick::Claimed),
                1 => run_id().prop_map(Pick::Any),
            ]
        }

        fn probe_outcome() -> impl Strategy<Value = ProbeOutcome> {
            prop_oneof![
                Just(ProbeOutcome::Healthy),
                Just(ProbeOutcome::Failed),
                proptest::option::of(prop_oneof![
                    Just(HealthFailureCode::Http5xx),
                    Just(HealthFailureCode::Timeout),
                ])
                .prop_map(ProbeOutcome::Unhealthy),
            ]
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (
                    run_id(),
                    any::<bool>(),
                    (1..20u64).prop_map(|n| n * 100),
                    proptest::option::of((0..60u64).prop_map(|n| n * 100)),
                )
                    .prop_map(|(run_id, tunnel, stall_ms, deadline_ms)| Op::Start {
                        run_id,
                        tunnel,
                        stall_ms,
                        deadline_ms,
                    }),
                6 => pick().prop_map(|pick| Op::Progress { pick }),
                1 => pick().prop_map(|pick| Op::Neutral { pick }),
                3 => (pick(), any::<bool>())
                    .prop_map(|(pick, failed)| Op::Return { pick, failed }),
                3 => (pick(), probe_outcome())
                    .prop_map(|(pick, outcome)| Op::Probe { pick, outcome }),
                1 => (pick(), any::<bool>()).prop_map(|(pick, disconnect)| Op::Cancel {
                    pick,
                    reason: if disconnect {
                        CancelReason::Disconnect
                    } else {
                        CancelReason::Client
                    },
                }),
                1 => Just(Op::Disconnect),
                1 => Just(Op::TakeSeq),
                // A coarse grid makes timers and inputs coincide often.
                8 => (0..25u64).prop_map(|n| Op::Advance { ms: n * 100 }),
                1 => (0..25u64).prop_map(|n| Op::Jump { ms: n * 100 }),
            ]
        }

        /// What caused the outputs being checked.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Cause {
            Timer,
            Input(RunId),
            Return { run_id: RunId, failed: bool },
            Probe(RunId, ProbeOutcome),
            Cancel(Option<RunId>, CancelReason),
        }

        /// The reference model of one started run.
        #[derive(Debug)]
        struct Model {
            stall_timeout: Duration,
            deadline: Option<Instant>,
            last_progress: Instant,
            provider_canceled: bool,
            claimed_at: Option<Instant>,
            /// The provider returned within the grace.
            returned_at: Option<Instant>,
            /// The probe verdict that arrived within the bound.
            verdict: Option<(Instant, ProbeOutcome)>,
            terminal_at: Option<Instant>,
        }

        impl Model {
            fn is_active(&self) -> bool {
                self.terminal_at.is_none()
            }
        }

        struct Sim {
            wd: Watchdog,
            now: Instant,
            grace: Duration,
            probe: Duration,
            max_active_runs: usize,
            /// Whether `Jump` moves the clock without firing timers; exact
            /// timing is checked only for a punctual driver.
            late_driver: bool,
            runs: BTreeMap<RunId, Model>,
            last_seq: u64,
            fenced: u64,
            unknown: u64,
        }

        impl Sim {
            fn new(
                grace_ms: u64,
                probe_ms: u64,
                max_active_runs: usize,
                late_driver: bool,
            ) -> Self {
                let config = WatchdogConfig {
                    close_grace: Duration::from_millis(grace_ms),
                    probe_bound: Duration::from_millis(probe_ms),
                    max_active_runs,
                };
                Self {
                    wd: Watchdog::new(config, Some(ObservationSequence::new())),
                    now: ms(1_000),
                    grace: config.close_grace,
                    probe: config.probe_bound,
                    max_active_runs,
                    late_driver,
                    runs: BTreeMap::new(),
                    last_seq: 0,
                    fenced: 0,
                    unknown: 0,
                }
            }

            fn resolve(&self, pick: Pick) -> RunId {
                let (index, claimed_only) = match pick {
                    Pick::Any(run_id) => return run_id,
                    Pick::Live(index) => (index, false),
                    Pick::Claimed(index) => (index, true),
                };
                let candidates: Vec<RunId> = self
                    .runs
                    .iter()
                    .filter(|(_, m)| m.is_active() && (!claimed_only || m.claimed_at.is_some()))
                    .map(|(run_id, _)| *run_id)
                    .collect();
                if candidates.is_empty() {
                    RunId::try_from(index % 10).expect("small")
                } else {
                    candidates[index % candidates.len()]
                }
            }

            fn active_before(&self, run_id: RunId) -> bool {
                self.runs.get(&run_id).is_some_and(Model::is_active)
            }

            fn apply(&mut self, op: &Op) {
                let now = self.now;
                match *op {
                    Op::Start {
                        run_id,
                        tunnel,
                        stall_ms,
                        deadline_ms,
                    } => {
                        let stall_timeout = effective_stall_timeout(stall_ms).expect("in range");
                        let deadline = deadline_ms.map(|d| now + Duration::from_millis(d));
                        let kind = if tunnel {
                            RunKind::Tunnel
                        } else {
                            RunKind::Normalized
                        };
                        let result = self.wd.start(now, run_id, kind, stall_timeout, deadline);
                        let active = self.runs.values().filter(|m| m.is_active()).count();
                        let expected = match self.runs.get(&run_id) {
                            Some(model) if model.is_active() => {
                                Err(WatchdogError::DuplicateRun { run_id })
                            }
                            Some(_) => Err(WatchdogError::FinishedRun { run_id }),
                            None if active >= self.max_active_runs => {
                                Err(WatchdogError::TooManyRuns {
                                    max_active_runs: self.max_active_runs,
                                })
                            }
                            None => Ok(()),
                        };
                        assert_eq!(result, expected);
                        if result.is_ok() {
                            self.runs.insert(
                                run_id,
                                Model {
                                    stall_timeout,
                                    deadline,
                                    last_progress: now,
                                    provider_canceled: false,
                                    claimed_at: None,
                                    returned_at: None,
                                    verdict: None,
                                    terminal_at: None,
                                },
                            );
                        }
                        let _ = self.absorb(Cause::Timer);
                    }
                    Op::Progress { pick } | Op::Neutral { pick } => {
                        let run_id = self.resolve(pick);
                        let active_before = self.active_before(run_id);
                        let emission = match op {
                            Op::Progress { .. } => self.wd.progress(now, run_id, Progress::Content),
                            _ => self.wd.neutral(now, run_id),
                        };
                        let _ = self.absorb(Cause::Input(run_id));
                        let forwardable = active_before
                            && self
                                .runs
                                .get(&run_id)
                                .is_some_and(|m| m.claimed_at.is_none() && m.terminal_at.is_none());
                        self.check_emission(run_id, emission, forwardable);
                        if emission == Emission::Forward {
                            self.assert_nothing_overdue(run_id);
                        }
                        if emission == Emission::Forward
                            && matches!(op, Op::Progress { .. })
                            && let Some(model) = self.runs.get_mut(&run_id)
                        {
                            model.last_progress = now;
                        }
                    }
                    Op::Return { pick, failed } => {
                        let run_id = self.resolve(pick);
                        let active_before = self.active_before(run_id);
                        let outcome = if failed {
                            ProviderOutcome::Failed(ExecutionFailure {
                                retryable: true,
                                provider_health: Some(ProviderHealth::Available),
                                health_observation_seq: Some(u64::MAX),
                                ..ExecutionFailure::new(FailureCode::ProviderError)
                            })
                        } else {
                            ProviderOutcome::Completed
                        };
                        let emission = self.wd.provider_returned(now, run_id, outcome);
                        let grace = self.grace;
                        // A stall claimed by an earlier input; one claimed by
                        // this input is recorded while draining.
                        if let Some(model) = self.runs.get_mut(&run_id)
                            && active_before
                            && let Some(claimed_at) = model.claimed_at
                            && model.returned_at.is_none()
                            && now < claimed_at + grace
                        {
                            model.returned_at = Some(now);
                        }
                        let ended_by_return = self.absorb(Cause::Return { run_id, failed });
                        self.check_emission(run_id, emission, ended_by_return);
                    }
                    Op::Probe { pick, outcome } => {
                        let run_id = self.resolve(pick);
                        let active_before = self.active_before(run_id);
                        self.wd.probe_result(now, run_id, outcome);
                        let probe = self.probe;
                        // A stall claimed by an earlier input; one claimed by
                        // this input is recorded while draining.
                        if let Some(model) = self.runs.get_mut(&run_id)
                            && active_before
                            && let Some(claimed_at) = model.claimed_at
                            && model.verdict.is_none()
                            && now < claimed_at + probe
                        {
                            model.verdict = Some((now, outcome));
                        }
                        let _ = self.absorb(Cause::Probe(run_id, outcome));
                    }
                    Op::Cancel { pick, reason } => {
                        let run_id = self.resolve(pick);
                        self.wd.cancel(now, run_id, reason);
                        let _ = self.absorb(Cause::Cancel(Some(run_id), reason));
                    }
                    Op::Disconnect => {
                        self.wd.cancel_all(now, CancelReason::Disconnect);
                        let _ = self.absorb(Cause::Cancel(None, CancelReason::Disconnect));
                        assert_eq!(self.wd.active_runs(), 0);
                    }
                    Op::TakeSeq => {
                        let seq = self.wd.take_observation_seq().expect("bound");
                        assert_eq!(seq, self.last_seq + 1, "unique and increasing");
                        self.last_seq = seq;
                    }
                    Op::Advance { ms: step } => self.advance(Duration::from_millis(step)),
                    Op::Jump { ms: step } if self.late_driver => {
                        self.now += Duration::from_millis(step);
                    }
                    Op::Jump { ms: step } => self.advance(Duration::from_millis(step)),
                }
                self.check_global();
            }

            /// Step time like a punctual driver: fire every timer on time.
            fn advance(&mut self, by: Duration) {
                let target = self.now + by;
                let mut wakeups = 0;
                while let Some(wakeup) = self.wd.poll_timeout() {
                    if wakeup > target {
                        break;
                    }
                    wakeups += 1;
                    assert!(wakeups < 10_000, "the timer makes progress");
                    self.now = self.now.max(wakeup);
                    self.wd.handle_timeout(self.now);
                    let _ = self.absorb(Cause::Timer);
                    self.check_global();
                }
                self.now = target;
            }

            fn check_emission(&mut self, run_id: RunId, emission: Emission, forward: bool) {
                assert_eq!(
                    emission == Emission::Forward,
                    forward,
                    "emission of {run_id}"
                );
                if emission == Emission::Fenced {
                    if self.runs.contains_key(&run_id) {
                        self.fenced += 1;
                    } else {
                        self.unknown += 1;
                    }
                }
                assert_eq!(self.wd.fenced_late_outputs(), self.fenced);
                assert_eq!(self.wd.unknown_run_outputs(), self.unknown);
            }

            /// Drain and check every output against the model; true if a
            /// provider return became a run's terminal.
            fn absorb(&mut self, cause: Cause) -> bool {
                let now = self.now;
                let outputs = drain(&mut self.wd);
                let mut previous: Option<&WatchdogOutput> = None;
                let mut ended_by_return = false;
                for output in &outputs {
                    let run_id = match output {
                        WatchdogOutput::CancelProvider { run_id }
                        | WatchdogOutput::StartProbe { run_id }
                        | WatchdogOutput::Terminal { run_id, .. }
                        | WatchdogOutput::StallObserved { run_id, .. } => *run_id,
                    };
                    if let Some(WatchdogOutput::StallObserved {
                        run_id: observed, ..
                    }) = previous
                    {
                        assert!(
                            matches!(output, WatchdogOutput::Terminal { run_id, .. } if run_id == observed),
                            "the stall terminal follows its observation"
                        );
                    }
                    let model = self
                        .runs
                        .get_mut(&run_id)
                        .expect("outputs only for started runs");
                    assert!(
                        model.is_active(),
                        "no output for {run_id} after its terminal"
                    );
                    match output {
                        WatchdogOutput::CancelProvider { .. } => {
                            assert!(!model.provider_canceled, "provider canceled once");
                            model.provider_canceled = true;
                        }
                        WatchdogOutput::StartProbe { .. } => {
                            assert_eq!(
                                previous,
                                Some(&WatchdogOutput::CancelProvider { run_id }),
                                "cancel the provider, then probe"
                            );
                            assert_eq!(model.claimed_at, None, "the stall is claimed once");
                            let stall_moment = model.last_progress + model.stall_timeout;
                            assert!(now >= stall_moment, "no claim before the stall moment");
                            if !self.late_driver {
                                assert_eq!(now, stall_moment, "claimed on time");
                            }
                            assert!(model.deadline.is_none_or(|d| now < d), "deadline wins");
                            model.claimed_at = Some(now);
                            // The input that made the claim applies after it.
                            match cause {
                                Cause::Return { run_id: r, .. }
                                    if r == run_id && !self.grace.is_zero() =>
                                {
                                    model.returned_at = Some(now);
                                }
                                Cause::Probe(r, outcome)
                                    if r == run_id && !self.probe.is_zero() =>
                                {
                                    model.verdict = Some((now, outcome));
                                }
                                _ => {}
                            }
                        }
                        WatchdogOutput::StallObserved { kind: _, .. } => {
                            assert!(model.claimed_at.is_some());
                        }
                        WatchdogOutput::Terminal { terminal, .. } => {
                            let observed = matches!(
                                previous,
                                Some(WatchdogOutput::StallObserved { run_id: r, .. }) if *r == run_id
                            );
                            ended_by_return |= matches!(
                                terminal,
                                RunTerminal::Completed
                                    | RunTerminal::Failed(ExecutionFailure {
                                        code: FailureCode::ProviderError,
                                        ..
                                    })
                            );
                            self.check_terminal(run_id, terminal, cause, observed, previous);
                        }
                    }
                    previous = Some(output);
                }
                assert!(
                    !matches!(previous, Some(WatchdogOutput::StallObserved { .. })),
                    "an observation is never the last output"
                );
                ended_by_return
            }

            fn check_terminal(
                &mut self,
                run_id: RunId,
                terminal: &RunTerminal,
                cause: Cause,
                observed: bool,
                previous: Option<&WatchdogOutput>,
            ) {
                let now = self.now;
                let (grace, probe) = (self.grace, self.probe);
                let model = self.runs.get_mut(&run_id).expect("started");
                assert_eq!(model.terminal_at, None, "exactly one terminal");
                model.terminal_at = Some(now);
                let deadline_passed = model.deadline.is_some_and(|d| d <= now);
                let failure = match terminal {
                    RunTerminal::Completed => {
                        assert_eq!(
                            cause,
                            Cause::Return {
                                run_id,
                                failed: false
                            }
                        );
                        assert!(!deadline_passed, "a deadline that passed wins");
                        assert!(
                            now < model.last_progress + model.stall_timeout,
                            "a stall that is due wins"
                        );
                        assert_eq!(model.claimed_at, None);
                        assert!(!model.provider_canceled);
                        return;
                    }
                    RunTerminal::Failed(failure) => failure,
                };
                if failure.code != FailureCode::ResponseStalled {
                    assert!(!observed, "only stalls are observed");
                    // Outside a stall the call has ended: retryable exactly
                    // for what another provider may answer (R-FAIL-1).
                    let other_provider_may_answer = failure.code
                        == FailureCode::ProviderUnreachable
                        || (failure.code == FailureCode::ProviderError
                            && failure
                                .http_status
                                .is_none_or(|s| s == 429 || (500..=599).contains(&s)));
                    assert_eq!(
                        failure.retryable, other_provider_may_answer,
                        "retry hint outside a stall (R-FAIL-1): {failure:?}"
                    );
                    assert_eq!(failure.provider_health, None);
                    assert_eq!(failure.health_observation_seq, None);
                    assert_eq!(failure.stall, None);
                }
                match failure.code {
                    FailureCode::ResponseStalled => {
                        assert!(observed, "a stall terminal is observed");
                        let claimed_at = model.claimed_at.expect("claimed");
                        assert!(model.provider_canceled);
                        assert!(!deadline_passed, "a deadline wins over the stall");
                        assert!(!matches!(cause, Cause::Cancel(..)));
                        // R-WD-3: emitted as soon as both joined, at the latest
                        // at claim + max(grace, probe bound).
                        let grace_until = claimed_at + grace;
                        let probe_until = claimed_at + probe;
                        let fence_done = model.returned_at.unwrap_or(grace_until);
                        let probe_done = model.verdict.map_or(probe_until, |(at, _)| at);
                        assert!(now >= fence_done.max(probe_done), "both joined");
                        if !self.late_driver {
                            assert_eq!(now, fence_done.max(probe_done), "emitted once joined");
                            assert!(now <= claimed_at + grace.max(probe));
                        }
                        // R-WD-4.
                        assert_eq!(failure.retryable, model.returned_at.is_some());
                        // R-WD-5.
                        let health = match model.verdict {
                            Some((_, ProbeOutcome::Healthy)) => ProviderHealth::Available,
                            Some((_, ProbeOutcome::Unhealthy(_))) => ProviderHealth::Unavailable,
                            Some((_, ProbeOutcome::Failed)) | None => ProviderHealth::Unknown,
                        };
                        assert_eq!(failure.provider_health, Some(health));
                        assert_eq!(
                            failure.liveness_classification,
                            Some(health.liveness_classification())
                        );
                        let stall = failure.stall.expect("stall metadata");
                        assert_eq!(stall.stall_timeout_ms, duration_ms(model.stall_timeout));
                        assert_eq!(
                            stall.elapsed_ms,
                            duration_ms(claimed_at - model.last_progress)
                        );
                        assert!(stall.elapsed_ms >= stall.stall_timeout_ms);
                        assert_eq!(
                            failure.health_failure,
                            Some(HealthFailureCode::ResponseStalled)
                        );
                        assert_eq!(failure.http_status, None);
                        // R-SEQ-1.
                        let seq = failure.health_observation_seq.expect("bound");
                        assert_eq!(seq, self.last_seq + 1, "unique and increasing");
                        self.last_seq = seq;
                        let Some(WatchdogOutput::StallObserved {
                            elapsed_ms,
                            health: observed_health,
                            retryable,
                            ..
                        }) = previous
                        else {
                            unreachable!("checked above");
                        };
                        assert_eq!(*elapsed_ms, stall.elapsed_ms);
                        assert_eq!(*observed_health, health);
                        assert_eq!(*retryable, failure.retryable);
                    }
                    FailureCode::DeadlineExceeded => {
                        let deadline = model.deadline.expect("a deadline");
                        assert!(deadline <= now, "not before the deadline");
                        if !self.late_driver {
                            assert_eq!(deadline, now, "fired on time");
                        }
                        assert!(model.provider_canceled);
                    }
                    FailureCode::Canceled => {
                        assert_eq!(cause, Cause::Cancel(Some(run_id), CancelReason::Client));
                        assert!(!deadline_passed);
                        assert!(model.provider_canceled);
                    }
                    FailureCode::TransportClosed => {
                        assert!(
                            matches!(
                                cause,
                                Cause::Cancel(Some(r), CancelReason::Disconnect) if r == run_id
                            ) || cause == Cause::Cancel(None, CancelReason::Disconnect)
                        );
                        assert!(!deadline_passed);
                        assert!(model.provider_canceled);
                    }
                    FailureCode::ProviderError => {
                        assert_eq!(
                            cause,
                            Cause::Return {
                                run_id,
                                failed: true
                            }
                        );
                        assert!(!deadline_passed, "a deadline that passed wins");
                        assert!(
                            now < model.last_progress + model.stall_timeout,
                            "a stall that is due wins"
                        );
                        assert_eq!(model.claimed_at, None);
                        assert!(!model.provider_canceled);
                    }
                    other => panic!("unexpected terminal code {other:?}"),
                }
            }

            /// Forwarded output must not slip in after a due stall or deadline.
            fn assert_nothing_overdue(&self, run_id: RunId) {
                let model = &self.runs[&run_id];
                assert!(self.now < model.last_progress + model.stall_timeout);
                assert!(model.deadline.is_none_or(|d| self.now < d));
            }

            fn check_global(&self) {
                let now = self.now;
                let active: Vec<&Model> = self.runs.values().filter(|m| m.is_active()).collect();
                assert_eq!(self.wd.active_runs(), active.len());
                for (run_id, model) in &self.runs {
                    assert_eq!(self.wd.is_active(*run_id), model.is_active());
                }
                // The next wake-up is never later than the earliest timer.
                let earliest = active
                    .iter()
                    .map(|model| {
                        let own = match model.claimed_at {
                            None => model.last_progress + model.stall_timeout,
                            Some(claimed_at) => {
                                let mut next = Instant::MAX;
                                let grace_until = claimed_at + self.grace;
                                if model.returned_at.is_none() && now < grace_until {
                                    next = next.min(grace_until);
                                }
                                let probe_until = claimed_at + self.probe;
                                if model.verdict.is_none() && now < probe_until {
                                    next = next.min(probe_until);
                                }
                                next
                            }
                        };
                        model.deadline.map_or(own, |d| own.min(d))
                    })
                    .min();
                match earliest {
                    None => assert_eq!(self.wd.poll_timeout(), None),
                    Some(earliest) => {
                        let wakeup = self
                            .wd
                            .poll_timeout()
                            .expect("a wake-up while runs are active");
                        assert!(wakeup <= earliest, "poll_timeout {wakeup:?} > {earliest:?}");
                    }
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 1000,
                ..ProptestConfig::default()
            })]

            #[test]
            fn every_run_gets_exactly_one_terminal_within_the_rules(
                grace_ms in (0..30u64).prop_map(|n| n * 100),
                probe_ms in (0..30u64).prop_map(|n| n * 100),
                max_active_runs in 1..6usize,
                late_driver in proptest::bool::weighted(0.25),
                ops in vec(op(), 1..80),
            ) {
                let mut sim = Sim::new(grace_ms, probe_ms, max_active_runs, late_driver);
                for op in &ops {
                    sim.apply(op);
                }
                // Let every remaining run reach its terminal.
                sim.advance(Duration::from_secs(60));
                prop_assert_eq!(sim.wd.active_runs(), 0);
                prop_assert_eq!(sim.wd.poll_timeout(), None);
                prop_assert!(sim.runs.values().all(|m| m.terminal_at.is_some()));
                prop_assert_eq!(sim.wd.next_observation_seq(), Some(sim.last_seq + 1));
            }
        }
    }
}
