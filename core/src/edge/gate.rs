//! The OpenAI stream gate (R-GATE-1..4).
//!
//! One [`StreamGate`] per client Chat Completions / Responses request,
//! streaming or not, normalized or tunnel (R-GATE-1). It alone owns the
//! commit point, cancellation, the attempts and the shared budget. It does
//! no I/O and no provider selection: the Edge shell feeds it what happened
//! ([`GateInput`]) and carries out what it says ([`GateOutput`]).
//!
//! ## Lifecycle
//!
//! 1. The shell creates the gate when the request is accepted and admits the
//!    first attempt with zero selection hints (R-SEL-1: normal selection).
//! 2. When admission places the attempt, the shell feeds
//!    [`GateInput::Dispatched`] and reads [`StreamGate::current_attempt`];
//!    every later event of that attempt is tagged with that [`AttemptId`], so
//!    a straggler of an older attempt can never commit or end the request.
//! 3. The shell holds response headers and bytes until [`GateOutput::Commit`]
//!    (the first content, R-GATE-2), then forwards directly. It classifies
//!    each node frame with [`AttemptFrame`], which says which frames are
//!    content, and feeds the event it names.
//! 4. Before commit, a confirmed typed stall ([`ConfirmedStall`], R-OVL-1)
//!    re-admits the request within the shared budget: the gate emits
//!    [`GateOutput::CloseTransport`] immediately followed by
//!    [`GateOutput::Readmit`] carrying the R-SEL-1 hints (R-GATE-2).
//! 5. Anything else ends the request with exactly one terminal
//!    ([`GateOutput::Finish`], [`GateOutput::FailBeforeCommit`] as an HTTP
//!    error or [`GateOutput::FailInStream`] as an SSE error event, R-GATE-3),
//!    or, after a client disconnect, with [`GateOutput::CancelRun`] and no
//!    terminal at all (R-GATE-4). Nothing is ever output after that.
//!
//! The total budget is the request's deadline: [`StreamGate::poll_timeout`]
//! returns it until the gate ends, and [`StreamGate::handle_timeout`] at or
//! after it cancels the run and ends the request.
//!
//! Observations for `iop_edge_liveness_recovery_eligibility_total` and
//! `iop_edge_liveness_recovery_results_total` are drained with
//! [`StreamGate::poll_event`]; their labels are closed enums.

use std::collections::VecDeque;
use std::time::Duration;

use iop_wire::{FailureCode, ProviderHealth, ProviderTunnelFrame, RunEventKind};

use crate::ids::ProviderId;
use crate::tenant::RefusalKind;
use crate::time::Instant;

/// The largest `max_attempts` a [`GateBudget`] accepts: the bound on how
/// many provider attempts one client request may consume.
pub const MAX_ATTEMPTS_LIMIT: u32 = 8;

/// The most outputs one input can queue: a pair such as `Commit` and
/// `Finish`, `CloseTransport` and `Readmit`, or `CancelRun` and a terminal.
/// Over its whole life a gate outputs at most `2 * max_attempts + 1` items,
/// so its queues stay bounded even if a driver drains late.
const OUTPUT_QUEUE_BOUND: usize = 2;

/// The shared budget of one request: attempts and total time (R-GATE-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GateBudget {
    max_attempts: u32,
    total: Duration,
}

/// Why a [`GateBudget`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GateBudgetError {
    /// `max_attempts` was zero or above [`MAX_ATTEMPTS_LIMIT`].
    #[error("max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}, got {0}")]
    MaxAttemptsOutOfRange(u32),
    /// The total time budget was zero.
    #[error("the total time budget must be greater than zero")]
    ZeroTotal,
}

impl GateBudget {
    /// A budget of `max_attempts` attempts (the first one included) and
    /// `total` time from the gate's creation.
    pub fn new(max_attempts: u32, total: Duration) -> Result<Self, GateBudgetError> {
        if max_attempts == 0 || max_attempts > MAX_ATTEMPTS_LIMIT {
            return Err(GateBudgetError::MaxAttemptsOutOfRange(max_attempts));
        }
        if total.is_zero() {
            return Err(GateBudgetError::ZeroTotal);
        }
        Ok(Self {
            max_attempts,
            total,
        })
    }

    /// How many attempts the request may use, the first one included.
    pub fn max_attempts(self) -> u32 {
        self.max_attempts
    }

    /// The total time the request may take, from the gate's creation.
    pub fn total(self) -> Duration {
        self.total
    }
}

/// The Edge-confirmed typed stall handoff (R-OVL-1: `recovery_handoff =
/// confirmed`), built by the Edge's lease/overlay code from a validated
/// current stall terminal. It carries no raw payload.
///
/// The handoff alone never grants replay: the gate decides eligibility.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConfirmedStall {
    /// The provider of the stalled lease.
    pub provider_id: ProviderId,
    /// The validated exact-target health evidence (R-WD-5).
    pub health: ProviderHealth,
}

/// One attempt of a request, numbered from 1 in dispatch order.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct AttemptId(u32);

impl AttemptId {
    /// The attempt's 1-based number.
    pub fn get(self) -> u32 {
        self.0
    }
}

/// Something that happened to one attempt.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptEvent {
    /// The provider accepted the request (a run start or a tunnel head) but
    /// sent no content yet. Not a commit: a stalled prefill stays
    /// recoverable (R-GATE-2).
    Started,
    /// The first text or tool-call delta, or tunnel body bytes carrying
    /// content. Commits (R-GATE-2); later content is forwarded directly.
    Content,
    /// The attempt ended normally.
    Completed,
    /// A confirmed typed stall of this attempt (R-OVL-1).
    Stalled(ConfirmedStall),
    /// Any other failure of this attempt; not recoverable here.
    Failed {
        /// The typed failure code.
        code: FailureCode,
    },
    /// The node connection carrying this attempt ended (its generation is
    /// fenced, R-GEN-3). Before commit it may fail over (R-FAIL-1): the
    /// node cancels every run of a lost connection (R-DISC-1).
    TransportLost,
    /// A failure whose provider call is known to have ended and that another
    /// provider may answer (the node marked it retryable: overloaded,
    /// unreachable, 5xx/429; see [`failure_may_fail_over`]). Before commit
    /// it fails over within the budget (R-FAIL-1); otherwise it ends the
    /// request like [`AttemptEvent::Failed`].
    FailedRetryable {
        /// The typed failure code.
        code: FailureCode,
    },
}

/// R-FAIL-1: may this terminal failure be re-admitted to another provider
/// before commit? Only when the node marked it retryable (the provider call
/// ended: R-WD-4) and it is not the client's: overloaded, unreachable,
/// a provider 5xx or 429, a lost connection. A client error (invalid
/// request, 4xx other than 429), a rejected credential, a cancel or a
/// deadline never is; a stall has its own path (R-GATE-2).
pub fn failure_may_fail_over(failure: &iop_wire::ExecutionFailure) -> bool {
    failure.retryable && crate::retry::class_may_fail_over(failure.code, failure.http_status)
}

/// What one frame of an attempt's node stream is to the gate: the commit
/// rule of R-GATE-2, written once for tunnels and normalized runs.
///
/// Only content commits: the first non-empty tunnel body bytes, or the
/// first text or tool-call delta. A run start or a tunnel head (status and
/// headers) starts the attempt without committing, so a stalled prefill
/// stays recoverable; an empty body chunk, an empty text delta and a usage
/// report are relayed with the attempt's other output but are no gate event
/// at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptFrame {
    /// Feed this event for the frame: [`AttemptEvent::Started`] or
    /// [`AttemptEvent::Content`].
    Event(AttemptEvent),
    /// Not a gate event; it never commits.
    NoEvent,
    /// The attempt's terminal frame (`End`/`Failure`, `Completed`/`Failed`).
    /// It becomes an event only once the dispatcher applied it (R-LEASE-1):
    /// [`AttemptEvent::Completed`], [`AttemptEvent::Failed`] or
    /// [`AttemptEvent::Stalled`] for an applied terminal,
    /// [`AttemptEvent::TransportLost`] for an ignored one.
    Terminal,
}

impl AttemptFrame {
    /// Classify a tunnel frame (R-GATE-2).
    pub fn from_tunnel_frame(frame: &ProviderTunnelFrame) -> Self {
        match frame {
            ProviderTunnelFrame::Head { .. } => AttemptFrame::Event(AttemptEvent::Started),
            ProviderTunnelFrame::Body(bytes) if bytes.is_empty() => AttemptFrame::NoEvent,
            ProviderTunnelFrame::Body(_) => AttemptFrame::Event(AttemptEvent::Content),
            ProviderTunnelFrame::End | ProviderTunnelFrame::Failure(_) => AttemptFrame::Terminal,
        }
    }

    /// Classify a normalized run event (R-GATE-2).
    pub fn from_run_event(kind: &RunEventKind) -> Self {
        match kind {
            RunEventKind::Started { .. } => AttemptFrame::Event(AttemptEvent::Started),
            RunEventKind::TextDelta(text) if text.is_empty() => AttemptFrame::NoEvent,
            RunEventKind::ReasoningDelta(text) if text.is_empty() => AttemptFrame::NoEvent,
            // Reasoning and embeddings are answer bytes a client sees.
            RunEventKind::TextDelta(_)
            | RunEventKind::ToolCallDelta(_)
            | RunEventKind::ReasoningDelta(_)
            | RunEventKind::Embedding(_) => AttemptFrame::Event(AttemptEvent::Content),
            // Log probabilities annotate text already sent; usage is metadata.
            RunEventKind::Usage(_) | RunEventKind::Logprobs(_) => AttemptFrame::NoEvent,
            RunEventKind::Completed { .. } | RunEventKind::Failed(_) => AttemptFrame::Terminal,
        }
    }
}

/// Why admission could not place an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionFailure {
    /// The queue is full (SPEC §5: 429 with Retry-After).
    QueueFull,
    /// No eligible provider serves the request.
    NoEligibleProvider,
    /// The attempt waited in the queue past the queue's own deadline.
    QueueTimeout,
    /// The tenant's limits refused the reservation of a further attempt
    /// that would send the prompt again (R-TEN-2): 429
    /// `rate_limit_exceeded` or `insufficient_quota`, no provider call.
    Tenant {
        /// Over a rate or over a quota or budget.
        kind: RefusalKind,
        /// When it may fit again, ms from the refusal (`None`: not by
        /// waiting, or not known: a name read back from a record).
        retry_after_ms: Option<u64>,
    },
}

impl AdmissionFailure {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            AdmissionFailure::QueueFull => "queue_full",
            AdmissionFailure::NoEligibleProvider => "no_eligible_provider",
            AdmissionFailure::QueueTimeout => "queue_timeout",
            AdmissionFailure::Tenant {
                kind: RefusalKind::RateLimited,
                ..
            } => "rate_limit_exceeded",
            AdmissionFailure::Tenant {
                kind: RefusalKind::InsufficientQuota,
                ..
            } => "insufficient_quota",
        }
    }

    /// The failure named `s` ([`Self::as_str`]'s inverse; a tenant's
    /// refusal comes back without its `retry_after_ms`).
    pub fn parse(s: &str) -> Option<Self> {
        [
            AdmissionFailure::QueueFull,
            AdmissionFailure::NoEligibleProvider,
            AdmissionFailure::QueueTimeout,
            AdmissionFailure::Tenant {
                kind: RefusalKind::RateLimited,
                retry_after_ms: None,
            },
            AdmissionFailure::Tenant {
                kind: RefusalKind::InsufficientQuota,
                retry_after_ms: None,
            },
        ]
        .into_iter()
        .find(|f| f.as_str() == s)
    }
}

/// An input to the gate.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateInput {
    /// Admission placed the pending attempt: it holds a lease on
    /// `provider_id` that passed the pre-send fence. Starts a new
    /// [`AttemptId`]. Fed before the request is sent, so a failure to open
    /// the node stream or to send is this attempt's event
    /// ([`AttemptEvent::TransportLost`] or [`AttemptEvent::Failed`]) and the
    /// shared budget governs it (R-GATE-1).
    Dispatched {
        /// The provider of the attempt's lease.
        provider_id: ProviderId,
    },
    /// Admission could not place the pending attempt.
    AdmissionFailed(AdmissionFailure),
    /// Something happened to the attempt `attempt`.
    Attempt {
        /// Which attempt; events of any attempt but the current are ignored.
        attempt: AttemptId,
        /// What happened.
        event: AttemptEvent,
    },
    /// The client went away (R-GATE-4).
    ClientDisconnected,
}

/// Why the gate ignored an input. Closed, for a counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IgnoredInput {
    /// The gate already ended.
    Ended,
    /// The event belongs to an attempt that is not the current one.
    NotCurrentAttempt,
    /// `Dispatched` or `AdmissionFailed` while no admission was pending.
    NotAdmitting,
}

impl IgnoredInput {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            IgnoredInput::Ended => "ended",
            IgnoredInput::NotCurrentAttempt => "not_current_attempt",
            IgnoredInput::NotAdmitting => "not_admitting",
        }
    }
}

/// What the gate did with an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum InputDisposition {
    /// The input was applied (it may have produced no output).
    Applied,
    /// The input was ignored, for this reason.
    Ignored(IgnoredInput),
}

/// Why a request failed. Closed; the shell picks the HTTP status or SSE
/// error body from it (R-GATE-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateFailure {
    /// Admission could not place an attempt.
    Admission(AdmissionFailure),
    /// The current attempt failed and could not be recovered; a stall that
    /// was not re-admitted ends as `Attempt(ResponseStalled)`, a lost node
    /// connection as `Attempt(TransportClosed)`.
    Attempt(FailureCode),
    /// The shared total-time budget ran out.
    BudgetExpired,
}

impl GateFailure {
    /// The stable lower-case name (a closed label value).
    pub fn as_str(self) -> &'static str {
        match self {
            GateFailure::Admission(failure) => failure.as_str(),
            GateFailure::Attempt(code) => code.as_str(),
            GateFailure::BudgetExpired => "budget_expired",
        }
    }

    /// The failure named `s` ([`Self::as_str`]'s inverse): a journal
    /// record keeps its failure by name.
    pub fn parse(s: &str) -> Option<Self> {
        if s == "budget_expired" {
            return Some(GateFailure::BudgetExpired);
        }
        AdmissionFailure::parse(s)
            .map(GateFailure::Admission)
            .or_else(|| FailureCode::parse(s).map(GateFailure::Attempt))
    }
}

/// What the shell must do, in the order given.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateOutput {
    /// Flush the held headers and bytes to the client; from now on forward
    /// directly. At most once per gate, never followed by a re-admission.
    Commit,
    /// Close the old attempt's transport. Always immediately followed by
    /// [`GateOutput::Readmit`] (R-GATE-2).
    CloseTransport {
        /// The attempt whose transport to close.
        attempt: AttemptId,
    },
    /// Admit a new attempt with these R-SEL-1 hints.
    Readmit {
        /// The stalled provider: prefer any runtime-eligible alternate.
        avoid_provider_id: ProviderId,
        /// Whether the avoided provider may still be chosen when no
        /// alternate exists; true only on probe-backed `available` evidence.
        allow_avoided_fallback: bool,
    },
    /// R-CONT-1: after commit, admit a new attempt that continues the
    /// answer the client already has (the committed attempt failed for
    /// good). Always right after [`GateOutput::CloseTransport`]; the failed
    /// provider is avoided.
    Continue {
        /// The failed attempt's provider.
        avoid_provider_id: ProviderId,
    },
    /// Cancel the run on the node and release its lease, or withdraw the
    /// pending admission when `attempt` is `None` (R-GATE-4, R-LEASE-2).
    CancelRun {
        /// The attempt to cancel, `None` while an admission is pending.
        attempt: Option<AttemptId>,
    },
    /// Terminal: answer with an HTTP error (nothing was committed).
    FailBeforeCommit {
        /// Why.
        kind: GateFailure,
    },
    /// Terminal: send one SSE error event in the API's format and end the
    /// stream (bytes were committed) (R-GATE-3).
    FailInStream {
        /// Why.
        kind: GateFailure,
    },
    /// Terminal: the request completed normally.
    Finish,
}

impl GateOutput {
    /// Whether this output is one of the three terminals.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            GateOutput::FailBeforeCommit { .. }
                | GateOutput::FailInStream { .. }
                | GateOutput::Finish
        )
    }
}

/// Whether a stall could be recovered, one per stall the gate sees.
/// Label of `iop_edge_liveness_recovery_eligibility_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryEligibility {
    /// A confirmed stall before commit within budget: re-admitted.
    Eligible,
    /// Bytes were already committed to the client.
    NotEligibleCommitted,
    /// Every attempt of the shared budget was used.
    NotEligibleAttempts,
    /// The shared total-time budget was spent.
    NotEligibleBudget,
    /// The stall was not an Edge-confirmed handoff for the current
    /// attempt's provider (R-OVL-1): fail closed.
    NotEligibleUnconfirmed,
}

impl RecoveryEligibility {
    /// The metric this value labels.
    pub const METRIC: &'static str = "iop_edge_liveness_recovery_eligibility_total";

    /// The stable lower-case name (a closed label value).
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryEligibility::Eligible => "eligible",
            RecoveryEligibility::NotEligibleCommitted => "not_eligible_committed",
            RecoveryEligibility::NotEligibleAttempts => "not_eligible_attempts",
            RecoveryEligibility::NotEligibleBudget => "not_eligible_budget",
            RecoveryEligibility::NotEligibleUnconfirmed => "not_eligible_unconfirmed",
        }
    }
}

/// What came of recovery. Label of `iop_edge_liveness_recovery_results_total`.
///
/// `Readmitted` counts every re-admission. Besides, a request emits at most
/// one outcome (`Recovered`, `Exhausted`, `Failed` or `Abandoned`), and
/// exactly one if it was ever re-admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryResult {
    /// A re-admission was issued.
    Readmitted,
    /// A re-admitted request committed (or completed without content).
    Recovered,
    /// A stall could not be recovered because the shared budget (attempts or
    /// time) was spent, or the time budget ran out during a recovery.
    Exhausted,
    /// A re-admitted request ended in another error before committing.
    Failed,
    /// The client disconnected during a recovery.
    Abandoned,
}

impl RecoveryResult {
    /// The metric this value labels.
    pub const METRIC: &'static str = "iop_edge_liveness_recovery_results_total";

    /// The stable lower-case name (a closed label value).
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryResult::Readmitted => "readmitted",
            RecoveryResult::Recovered => "recovered",
            RecoveryResult::Exhausted => "exhausted",
            RecoveryResult::Failed => "failed",
            RecoveryResult::Abandoned => "abandoned",
        }
    }
}

/// An observation for the recovery counters and the
/// `edge_liveness_recovery_observation` log event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateEvent {
    /// Count once in `iop_edge_liveness_recovery_eligibility_total`.
    Eligibility(RecoveryEligibility),
    /// Count once in `iop_edge_liveness_recovery_results_total`.
    Result(RecoveryResult),
}

/// How a gate ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateEnd {
    /// [`GateOutput::Finish`] was emitted.
    Finished,
    /// A failure terminal was emitted.
    Failed {
        /// Why.
        kind: GateFailure,
        /// Whether it went out in-stream ([`GateOutput::FailInStream`]).
        in_stream: bool,
    },
    /// The client disconnected; the run was canceled, no terminal was sent.
    ClientDisconnected,
}

#[derive(Debug, Clone)]
enum Phase {
    /// Waiting for admission to place the next attempt.
    Admitting,
    /// An attempt is in flight.
    Running {
        attempt: AttemptId,
        provider_id: ProviderId,
    },
    /// The gate ended; it outputs nothing more.
    Ended(GateEnd),
}

/// The per-request owner of commit, cancellation, attempts and the shared
/// budget (R-GATE-1..4). See the [module docs](self) for the lifecycle.
#[derive(Debug, Clone)]
pub struct StreamGate {
    budget: GateBudget,
    deadline: Instant,
    phase: Phase,
    attempts: u32,
    readmissions: u32,
    committed: bool,
    started: bool,
    outcome_emitted: bool,
    /// Whether a failed attempt may go to another provider (R-FAIL-1):
    /// only when the request's pool has one.
    failover: bool,
    /// Whether a committed attempt that failed for good may be continued
    /// on another provider (R-CONT-1): the route opted in and no tool call
    /// is half-written.
    continuation: bool,
    /// What the last ended attempt failed with: a re-admission that finds
    /// no provider to go to ends with it (R-FAIL-1).
    last_failure: Option<FailureCode>,
    outputs: VecDeque<GateOutput>,
    events: VecDeque<GateEvent>,
}

impl StreamGate {
    /// A gate for a request accepted at `now`. The shell admits the first
    /// attempt with zero selection hints right away.
    pub fn new(now: Instant, budget: GateBudget) -> Self {
        Self {
            budget,
            deadline: now.saturating_add(budget.total),
            phase: Phase::Admitting,
            attempts: 0,
            readmissions: 0,
            committed: false,
            started: false,
            outcome_emitted: false,
            failover: true,
            continuation: false,
            last_failure: None,
            outputs: VecDeque::with_capacity(OUTPUT_QUEUE_BOUND),
            events: VecDeque::new(),
        }
    }

    /// Whether a failed attempt may be re-admitted to another provider
    /// (R-FAIL-1); on by default. Off for a request whose pool has a single
    /// provider: avoiding it would leave nothing to choose.
    pub fn set_failover(&mut self, failover: bool) {
        self.failover = failover;
    }

    /// Whether a committed attempt that fails for good may be continued on
    /// another provider of the pool (R-CONT-1); off by default. The request
    /// turns it off for good once a tool call was partly delivered.
    pub fn set_continuation(&mut self, continuation: bool) {
        self.continuation = continuation;
    }

    /// Feed one input at `now`, then drain [`Self::poll_output`] and
    /// [`Self::poll_event`].
    pub fn handle_input(&mut self, now: Instant, input: GateInput) -> InputDisposition {
        match input {
            GateInput::Dispatched { provider_id } => self.on_dispatched(provider_id),
            GateInput::AdmissionFailed(failure) => self.on_admission_failed(failure),
            GateInput::Attempt { attempt, event } => self.on_attempt(now, attempt, event),
            GateInput::ClientDisconnected => self.on_client_disconnected(),
        }
    }

    /// The next output to carry out; call until `None` after every input and
    /// timeout.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<GateOutput> {
        self.outputs.pop_front()
    }

    /// The next observation for the recovery counters; call until `None`
    /// after every input and timeout.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<GateEvent> {
        self.events.pop_front()
    }

    /// When to call [`Self::handle_timeout`]: the end of the total budget,
    /// or `None` once the gate ended.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            Phase::Ended(_) => None,
            Phase::Admitting | Phase::Running { .. } => Some(self.deadline),
        }
    }

    /// Fire the budget timer. At or after the deadline the run (or pending
    /// admission) is canceled and the request ends with
    /// [`GateFailure::BudgetExpired`] (R-GATE-3); earlier it does nothing.
    pub fn handle_timeout(&mut self, now: Instant) {
        if now < self.deadline {
            return;
        }
        let attempt = match &self.phase {
            Phase::Ended(_) => return,
            Phase::Admitting => None,
            Phase::Running { attempt, .. } => Some(*attempt),
        };
        self.push_output(GateOutput::CancelRun { attempt });
        self.fail(GateFailure::BudgetExpired, RecoveryResult::Exhausted);
    }

    /// The current attempt, `None` while an admission is pending or after
    /// the end.
    pub fn current_attempt(&self) -> Option<AttemptId> {
        match self.phase {
            Phase::Running { attempt, .. } => Some(attempt),
            Phase::Admitting | Phase::Ended(_) => None,
        }
    }

    /// How many attempts were dispatched; never above the budget's
    /// `max_attempts`.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// How many re-admissions were issued.
    pub fn readmissions(&self) -> u32 {
        self.readmissions
    }

    /// Whether bytes were committed to the client.
    pub fn is_committed(&self) -> bool {
        self.committed
    }

    /// Whether the current attempt's provider accepted the request.
    pub fn is_started(&self) -> bool {
        self.started
    }

    /// How the gate ended, `None` while it runs.
    pub fn end(&self) -> Option<GateEnd> {
        match self.phase {
            Phase::Ended(end) => Some(end),
            Phase::Admitting | Phase::Running { .. } => None,
        }
    }

    /// The budget this gate was created with.
    pub fn budget(&self) -> GateBudget {
        self.budget
    }

    /// The moment the total budget runs out.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    fn on_dispatched(&mut self, provider_id: ProviderId) -> InputDisposition {
        match self.phase {
            Phase::Ended(_) => return InputDisposition::Ignored(IgnoredInput::Ended),
            Phase::Running { .. } => return InputDisposition::Ignored(IgnoredInput::NotAdmitting),
            Phase::Admitting => {}
        }
        // Re-admission is only issued with an attempt to spare.
        debug_assert!(self.attempts < self.budget.max_attempts);
        if self.attempts >= self.budget.max_attempts {
            return InputDisposition::Ignored(IgnoredInput::NotAdmitting);
        }
        self.attempts += 1;
        self.started = false;
        self.phase = Phase::Running {
            attempt: AttemptId(self.attempts),
            provider_id,
        };
        InputDisposition::Applied
    }

    fn on_admission_failed(&mut self, failure: AdmissionFailure) -> InputDisposition {
        match self.phase {
            Phase::Ended(_) => InputDisposition::Ignored(IgnoredInput::Ended),
            Phase::Running { .. } => InputDisposition::Ignored(IgnoredInput::NotAdmitting),
            Phase::Admitting => {
                // R-FAIL-1: a re-admission with no provider to go to ends
                // with what its last attempt met, not with the admission's
                // own refusal: that is the answer the client can act on.
                let kind = match (failure, self.last_failure) {
                    (AdmissionFailure::NoEligibleProvider, Some(code)) => {
                        GateFailure::Attempt(code)
                    }
                    _ => GateFailure::Admission(failure),
                };
                self.fail(kind, RecoveryResult::Failed);
                InputDisposition::Applied
            }
        }
    }

    fn on_attempt(
        &mut self,
        now: Instant,
        attempt: AttemptId,
        event: AttemptEvent,
    ) -> InputDisposition {
        let provider_id = match &self.phase {
            Phase::Ended(_) => return InputDisposition::Ignored(IgnoredInput::Ended),
            Phase::Running {
                attempt: current,
                provider_id,
            } if *current == attempt => provider_id.clone(),
            Phase::Admitting | Phase::Running { .. } => {
                return InputDisposition::Ignored(IgnoredInput::NotCurrentAttempt);
            }
        };
        match &event {
            AttemptEvent::Failed { code } | AttemptEvent::FailedRetryable { code } => {
                self.last_failure = Some(*code);
            }
            AttemptEvent::TransportLost => self.last_failure = Some(FailureCode::TransportClosed),
            AttemptEvent::Stalled(_) => self.last_failure = Some(FailureCode::ResponseStalled),
            AttemptEvent::Started | AttemptEvent::Content | AttemptEvent::Completed => {}
        }
        match event {
            AttemptEvent::Started => self.started = true,
            AttemptEvent::Content => self.commit(),
            AttemptEvent::Completed => {
                // An answer without content still has to reach the client.
                self.commit();
                self.push_output(GateOutput::Finish);
                self.phase = Phase::Ended(GateEnd::Finished);
            }
            AttemptEvent::Stalled(stall) => self.on_stall(now, attempt, &provider_id, stall),
            AttemptEvent::Failed { code } if self.may_continue(now, code) => {
                self.continue_answer(attempt, provider_id);
            }
            AttemptEvent::Failed { code } => {
                if code == FailureCode::ResponseStalled {
                    // A stall without the Edge's confirmation never re-admits.
                    let eligibility = if self.committed {
                        RecoveryEligibility::NotEligibleCommitted
                    } else {
                        RecoveryEligibility::NotEligibleUnconfirmed
                    };
                    self.events.push_back(GateEvent::Eligibility(eligibility));
                }
                self.fail(GateFailure::Attempt(code), RecoveryResult::Failed);
            }
            AttemptEvent::TransportLost if self.may_continue(now, FailureCode::TransportClosed) => {
                self.continue_answer(attempt, provider_id);
            }
            AttemptEvent::TransportLost => {
                // R-GEN-3: one transport terminal towards the client,
                // unless another provider can still answer (R-FAIL-1).
                if !self.fail_over(now, attempt, provider_id) {
                    self.fail(
                        GateFailure::Attempt(FailureCode::TransportClosed),
                        RecoveryResult::Failed,
                    );
                }
            }
            AttemptEvent::FailedRetryable { code } if self.may_continue(now, code) => {
                self.continue_answer(attempt, provider_id);
            }
            AttemptEvent::FailedRetryable { code } => {
                if !self.fail_over(now, attempt, provider_id) {
                    self.fail(GateFailure::Attempt(code), RecoveryResult::Failed);
                }
            }
        }
        InputDisposition::Applied
    }

    /// R-CONT-1: may a committed attempt that failed with `code` be
    /// continued on another provider? Only with continuation on, an attempt
    /// and time to spare, and a failure of the provider or its transport (a
    /// cancel, a client error or a refused credential is the answer).
    fn may_continue(&self, now: Instant, code: FailureCode) -> bool {
        let provider_side = matches!(
            code,
            FailureCode::ProviderError
                | FailureCode::ProviderUnreachable
                | FailureCode::ResponseStalled
                | FailureCode::MalformedResponse
                | FailureCode::TransportClosed
                | FailureCode::NodeOverloaded
                | FailureCode::Internal
        );
        self.committed
            && self.continuation
            && self.failover
            && provider_side
            && self.attempts < self.budget.max_attempts
            && now < self.deadline
    }

    /// R-CONT-1: close the failed attempt and admit the one that continues.
    fn continue_answer(&mut self, attempt: AttemptId, provider_id: ProviderId) {
        self.readmissions += 1;
        self.push_output(GateOutput::CloseTransport { attempt });
        self.push_output(GateOutput::Continue {
            avoid_provider_id: provider_id,
        });
        self.events
            .push_back(GateEvent::Result(RecoveryResult::Readmitted));
        self.started = false;
        self.phase = Phase::Admitting;
    }

    /// R-FAIL-1: before commit, within the shared budget, re-admit a failed
    /// attempt to another provider (the failed one avoided, never allowed
    /// back by this hint). Returns whether it did.
    fn fail_over(&mut self, now: Instant, attempt: AttemptId, provider_id: ProviderId) -> bool {
        if !self.failover
            || self.committed
            || self.attempts >= self.budget.max_attempts
            || now >= self.deadline
        {
            return false;
        }
        self.readmissions += 1;
        // The old transport is closed before re-admission (R-GATE-2).
        self.push_output(GateOutput::CloseTransport { attempt });
        self.push_output(GateOutput::Readmit {
            avoid_provider_id: provider_id,
            allow_avoided_fallback: false,
        });
        self.events
            .push_back(GateEvent::Result(RecoveryResult::Readmitted));
        self.started = false;
        self.phase = Phase::Admitting;
        true
    }

    /// R-GATE-2: before commit, a confirmed stall of the current attempt's
    /// provider re-admits within the shared budget; otherwise one terminal.
    fn on_stall(
        &mut self,
        now: Instant,
        attempt: AttemptId,
        provider_id: &ProviderId,
        stall: ConfirmedStall,
    ) {
        if self.may_continue(now, FailureCode::ResponseStalled) {
            // R-CONT-1: a committed answer whose provider stalled goes on
            // elsewhere.
            self.events.push_back(GateEvent::Eligibility(
                RecoveryEligibility::NotEligibleCommitted,
            ));
            self.continue_answer(attempt, provider_id.clone());
            return;
        }
        let eligibility = if self.committed {
            RecoveryEligibility::NotEligibleCommitted
        } else if stall.provider_id != *provider_id {
            RecoveryEligibility::NotEligibleUnconfirmed
        } else if self.attempts >= self.budget.max_attempts {
            RecoveryEligibility::NotEligibleAttempts
        } else if now >= self.deadline {
            RecoveryEligibility::NotEligibleBudget
        } else {
            RecoveryEligibility::Eligible
        };
        self.events.push_back(GateEvent::Eligibility(eligibility));
        let stalled = GateFailure::Attempt(FailureCode::ResponseStalled);
        match eligibility {
            RecoveryEligibility::Eligible => {
                self.readmissions += 1;
                // The old transport is closed before re-admission (R-GATE-2).
                self.push_output(GateOutput::CloseTransport { attempt });
                self.push_output(GateOutput::Readmit {
                    avoid_provider_id: stall.provider_id,
                    // R-SEL-1: only probe-backed `available` evidence lets
                    // the avoided provider be chosen again.
                    allow_avoided_fallback: stall.health == ProviderHealth::Available,
                });
                self.events
                    .push_back(GateEvent::Result(RecoveryResult::Readmitted));
                self.started = false;
                self.phase = Phase::Admitting;
            }
            RecoveryEligibility::NotEligibleAttempts | RecoveryEligibility::NotEligibleBudget => {
                self.emit_outcome(RecoveryResult::Exhausted);
                self.fail(stalled, RecoveryResult::Exhausted);
            }
            RecoveryEligibility::NotEligibleCommitted
            | RecoveryEligibility::NotEligibleUnconfirmed => {
                self.fail(stalled, RecoveryResult::Failed);
            }
        }
    }

    fn on_client_disconnected(&mut self) -> InputDisposition {
        let attempt = match &self.phase {
            Phase::Ended(_) => return InputDisposition::Ignored(IgnoredInput::Ended),
            Phase::Admitting => None,
            Phase::Running { attempt, .. } => Some(*attempt),
        };
        // R-GATE-4: cancel the run and release the lease; nobody is left to
        // receive a terminal.
        self.push_output(GateOutput::CancelRun { attempt });
        self.emit_outcome_if_recovering(RecoveryResult::Abandoned);
        self.phase = Phase::Ended(GateEnd::ClientDisconnected);
        InputDisposition::Applied
    }

    fn commit(&mut self) {
        if self.committed {
            return;
        }
        self.committed = true;
        self.push_output(GateOutput::Commit);
        self.emit_outcome_if_recovering(RecoveryResult::Recovered);
    }

    /// End with one failure terminal in the format the commit state allows
    /// (R-GATE-3).
    fn fail(&mut self, kind: GateFailure, outcome: RecoveryResult) {
        debug_assert!(!matches!(self.phase, Phase::Ended(_)));
        self.emit_outcome_if_recovering(outcome);
        let in_stream = self.committed;
        self.push_output(if in_stream {
            GateOutput::FailInStream { kind }
        } else {
            GateOutput::FailBeforeCommit { kind }
        });
        self.phase = Phase::Ended(GateEnd::Failed { kind, in_stream });
    }

    fn emit_outcome_if_recovering(&mut self, outcome: RecoveryResult) {
        if self.readmissions > 0 {
            self.emit_outcome(outcome);
        }
    }

    fn emit_outcome(&mut self, outcome: RecoveryResult) {
        if !self.outcome_emitted {
            self.outcome_emitted = true;
            self.events.push_back(GateEvent::Result(outcome));
        }
    }

    fn push_output(&mut self, output: GateOutput) {
        debug_assert!(
            !matches!(self.phase, Phase::Ended(_)),
            "no output after the terminal"
        );
        self.outputs.push_back(output);
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

    #[test]
    fn every_gate_failure_parses_back_from_its_name() {
        let mut all = vec![GateFailure::BudgetExpired];
        all.extend(
            [
                AdmissionFailure::QueueFull,
                AdmissionFailure::NoEligibleProvider,
                AdmissionFailure::QueueTimeout,
                AdmissionFailure::Tenant {
                    kind: RefusalKind::RateLimited,
                    retry_after_ms: None,
                },
                AdmissionFailure::Tenant {
                    kind: RefusalKind::InsufficientQuota,
                    retry_after_ms: None,
                },
            ]
            .map(GateFailure::Admission),
        );
        all.extend(FailureCode::ALL.iter().copied().map(GateFailure::Attempt));
        for failure in all {
            assert_eq!(GateFailure::parse(failure.as_str()), Some(failure));
        }
        assert_eq!(GateFailure::parse("nonsense"), None);
    }

    #[test]
    fn budget_and_labels_are_what_was_given() {
        let budget = GateBudget::new(3, 7 * SECOND).expect("valid");
        assert_eq!((budget.max_attempts(), budget.total()), (3, 7 * SECOND));
        // R-OBS-1: closed label values.
        let failures = [
            AdmissionFailure::QueueFull,
            AdmissionFailure::NoEligibleProvider,
            AdmissionFailure::QueueTimeout,
        ]
        .map(AdmissionFailure::as_str);
        assert_eq!(
            failures,
            ["queue_full", "no_eligible_provider", "queue_timeout"]
        );
        let ignored = [
            IgnoredInput::Ended,
            IgnoredInput::NotCurrentAttempt,
            IgnoredInput::NotAdmitting,
        ]
        .map(IgnoredInput::as_str);
        assert_eq!(ignored, ["ended", "not_current_attempt", "not_admitting"]);
    }

    fn gate(max_attempts: u32, total: Duration) -> StreamGate {
        let budget = GateBudget::new(max_attempts, total).expect("valid test budget");
        StreamGate::new(Instant::ZERO, budget)
    }

    fn drain(gate: &mut StreamGate) -> Vec<GateOutput> {
        std::iter::from_fn(|| gate.poll_output()).collect()
    }

    fn drain_events(gate: &mut StreamGate) -> Vec<GateEvent> {
        std::iter::from_fn(|| gate.poll_event()).collect()
    }

    fn dispatch(gate: &mut StreamGate, now: Instant, provider: &str) -> AttemptId {
        assert_eq!(
            gate.handle_input(
                now,
                GateInput::Dispatched {
                    provider_id: pid(provider)
                }
            ),
            InputDisposition::Applied
        );
        gate.current_attempt().expect("an attempt after dispatch")
    }

    fn attempt(
        gate: &mut StreamGate,
        now: Instant,
        attempt: AttemptId,
        event: AttemptEvent,
    ) -> Vec<GateOutput> {
        assert_eq!(
            gate.handle_input(now, GateInput::Attempt { attempt, event }),
            InputDisposition::Applied
        );
        drain(gate)
    }

    fn stall(provider: &str, health: ProviderHealth) -> AttemptEvent {
        AttemptEvent::Stalled(ConfirmedStall {
            provider_id: pid(provider),
            health,
        })
    }

    /// A committed gate on attempt 1 of `p1`, continuation as given.
    fn committed(continuation: bool, attempts: u32) -> StreamGate {
        let mut g = StreamGate::new(
            Instant::ZERO,
            GateBudget::new(attempts, 10 * SECOND).unwrap(),
        );
        g.set_continuation(continuation);
        let _ = g.handle_input(
            Instant::ZERO,
            GateInput::Dispatched {
                provider_id: pid("p1"),
            },
        );
        let attempt = g.current_attempt().unwrap();
        let _ = g.handle_input(
            Instant::ZERO,
            GateInput::Attempt {
                attempt,
                event: AttemptEvent::Content,
            },
        );
        while g.poll_output().is_some() {}
        g
    }

    fn outputs(g: &mut StreamGate) -> Vec<GateOutput> {
        std::iter::from_fn(|| g.poll_output()).collect()
    }

    #[test]
    fn a_continuation_counts_as_a_readmission_and_needs_an_attempt_left() {
        let failed = AttemptEvent::Failed {
            code: FailureCode::MalformedResponse,
        };
        // Attempts left: continued, counted once.
        let mut g = committed(true, 2);
        let a1 = g.current_attempt().unwrap();
        let out = attempt(&mut g, Instant::ZERO, a1, failed.clone());
        assert!(
            out.iter().any(|o| matches!(o, GateOutput::Continue { .. })),
            "{out:?}"
        );
        assert_eq!(g.readmissions(), 1);
        // The one attempt was the last: one in-stream error, no continuation.
        let mut g = committed(true, 1);
        let a1 = g.current_attempt().unwrap();
        let out = attempt(&mut g, Instant::ZERO, a1, failed);
        assert!(
            out.iter()
                .any(|o| matches!(o, GateOutput::FailInStream { .. }))
                && !out.iter().any(|o| matches!(o, GateOutput::Continue { .. })),
            "{out:?}"
        );
        assert_eq!(g.readmissions(), 0);
        // At the deadline itself no time is left to continue in.
        let mut g = committed(true, 3);
        let a1 = g.current_attempt().unwrap();
        let failed = AttemptEvent::Failed {
            code: FailureCode::MalformedResponse,
        };
        let out = attempt(
            &mut g,
            Instant::ZERO.saturating_add(10 * SECOND),
            a1,
            failed,
        );
        assert!(
            !out.iter().any(|o| matches!(o, GateOutput::Continue { .. })),
            "{out:?}"
        );
    }

    #[test]
    fn only_a_stall_failure_reports_its_recovery_eligibility() {
        for (code, expected) in [
            (
                FailureCode::ResponseStalled,
                vec![RecoveryEligibility::NotEligibleUnconfirmed],
            ),
            (FailureCode::ProviderError, vec![]),
        ] {
            let mut g = gate(3, 60 * SECOND);
            let a1 = dispatch(&mut g, Instant::ZERO, "p1");
            let _ = drain_events(&mut g);
            let _ = attempt(&mut g, Instant::ZERO, a1, AttemptEvent::Failed { code });
            let eligibility: Vec<RecoveryEligibility> = drain_events(&mut g)
                .into_iter()
                .filter_map(|e| match e {
                    GateEvent::Eligibility(e) => Some(e),
                    _ => None,
                })
                .collect();
            assert_eq!(eligibility, expected, "{code:?}");
        }
    }

    #[test]
    fn r_cont_1_a_committed_attempt_that_fails_for_good_continues_elsewhere_when_opted_in() {
        for event in [
            AttemptEvent::TransportLost,
            AttemptEvent::FailedRetryable {
                code: FailureCode::ProviderError,
            },
            AttemptEvent::Failed {
                code: FailureCode::MalformedResponse,
            },
        ] {
            let mut g = committed(true, 3);
            let attempt = g.current_attempt().unwrap();
            let _ = g.handle_input(
                Instant::ZERO.saturating_add(SECOND),
                GateInput::Attempt {
                    attempt,
                    event: event.clone(),
                },
            );
            assert_eq!(
                outputs(&mut g),
                vec![
                    GateOutput::CloseTransport { attempt },
                    GateOutput::Continue {
                        avoid_provider_id: pid("p1")
                    }
                ],
                "{event:?}"
            );
            // The next attempt goes on committed: its content commits
            // nothing again, its completion finishes.
            let _ = g.handle_input(
                Instant::ZERO.saturating_add(SECOND),
                GateInput::Dispatched {
                    provider_id: pid("p2"),
                },
            );
            let next = g.current_attempt().unwrap();
            assert_ne!(next, attempt);
            let _ = g.handle_input(
                Instant::ZERO.saturating_add(SECOND),
                GateInput::Attempt {
                    attempt: next,
                    event: AttemptEvent::Content,
                },
            );
            assert!(outputs(&mut g).is_empty());
            let _ = g.handle_input(
                Instant::ZERO.saturating_add(SECOND),
                GateInput::Attempt {
                    attempt: next,
                    event: AttemptEvent::Completed,
                },
            );
            assert_eq!(outputs(&mut g), vec![GateOutput::Finish]);
        }
    }

    #[test]
    fn r_cont_1_no_continuation_when_off_canceled_a_client_error_or_out_of_attempts() {
        let lost = AttemptEvent::TransportLost;
        let cases = [
            (committed(false, 3), lost.clone()),
            (committed(true, 1), lost),
            (
                committed(true, 3),
                AttemptEvent::Failed {
                    code: FailureCode::Canceled,
                },
            ),
            (
                committed(true, 3),
                AttemptEvent::Failed {
                    code: FailureCode::InvalidRequest,
                },
            ),
            (
                committed(true, 3),
                AttemptEvent::Failed {
                    code: FailureCode::CredentialRejected,
                },
            ),
        ];
        for (mut g, event) in cases {
            let attempt = g.current_attempt().unwrap();
            let _ = g.handle_input(
                Instant::ZERO.saturating_add(SECOND),
                GateInput::Attempt {
                    attempt,
                    event: event.clone(),
                },
            );
            let outs = outputs(&mut g);
            assert!(
                matches!(&outs[..], [GateOutput::FailInStream { .. }]),
                "{event:?}: {outs:?}"
            );
        }
        // Past the deadline, neither.
        let mut g = committed(true, 3);
        let attempt = g.current_attempt().unwrap();
        let _ = g.handle_input(
            Instant::ZERO.saturating_add(20 * SECOND),
            GateInput::Attempt {
                attempt,
                event: AttemptEvent::TransportLost,
            },
        );
        assert!(matches!(
            &outputs(&mut g)[..],
            [GateOutput::FailInStream { .. }]
        ));
    }

    #[test]
    fn budget_is_bounded() {
        assert_eq!(
            GateBudget::new(0, SECOND),
            Err(GateBudgetError::MaxAttemptsOutOfRange(0))
        );
        assert!(GateBudget::new(MAX_ATTEMPTS_LIMIT, SECOND).is_ok());
        assert_eq!(
            GateBudget::new(MAX_ATTEMPTS_LIMIT + 1, SECOND),
            Err(GateBudgetError::MaxAttemptsOutOfRange(
                MAX_ATTEMPTS_LIMIT + 1
            ))
        );
        assert_eq!(
            GateBudget::new(1, Duration::ZERO),
            Err(GateBudgetError::ZeroTotal)
        );
    }

    #[test]
    fn tunnel_frames_commit_on_the_first_non_empty_body_bytes_only() {
        use iop_wire::ExecutionFailure;
        let head = ProviderTunnelFrame::Head {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
        };
        assert_eq!(
            AttemptFrame::from_tunnel_frame(&head),
            AttemptFrame::Event(AttemptEvent::Started)
        );
        assert_eq!(
            AttemptFrame::from_tunnel_frame(&ProviderTunnelFrame::Body(Vec::new())),
            AttemptFrame::NoEvent
        );
        assert_eq!(
            AttemptFrame::from_tunnel_frame(&ProviderTunnelFrame::Body(b"d".to_vec())),
            AttemptFrame::Event(AttemptEvent::Content)
        );
        for terminal in [
            ProviderTunnelFrame::End,
            ProviderTunnelFrame::Failure(ExecutionFailure::new(FailureCode::ProviderError)),
        ] {
            assert_eq!(
                AttemptFrame::from_tunnel_frame(&terminal),
                AttemptFrame::Terminal
            );
        }
    }

    #[test]
    fn reasoning_and_embeddings_commit_and_logprobs_do_not_r_gate_2() {
        use iop_wire::{Embedding, TokenLogprob};
        let content = AttemptFrame::Event(AttemptEvent::Content);
        let cases = [
            (
                RunEventKind::ReasoningDelta(String::new()),
                AttemptFrame::NoEvent,
            ),
            (RunEventKind::ReasoningDelta("hmm".into()), content.clone()),
            (
                RunEventKind::Embedding(Embedding {
                    index: 0,
                    values: vec![0.5],
                }),
                content,
            ),
            (
                RunEventKind::Logprobs(vec![TokenLogprob {
                    token: "a".into(),
                    logprob: -0.1,
                    top: Vec::new(),
                }]),
                AttemptFrame::NoEvent,
            ),
        ];
        for (kind, expected) in cases {
            assert_eq!(AttemptFrame::from_run_event(&kind), expected, "{kind:?}");
        }
    }

    #[test]
    fn run_events_commit_on_the_first_text_or_tool_call_delta_only() {
        use iop_wire::{ExecutionFailure, FinishReason, ToolCallDelta, Usage};
        let content = AttemptFrame::Event(AttemptEvent::Content);
        let cases = [
            (
                RunEventKind::Started {
                    session_id: "s".into(),
                },
                AttemptFrame::Event(AttemptEvent::Started),
            ),
            (
                RunEventKind::TextDelta(String::new()),
                AttemptFrame::NoEvent,
            ),
            (RunEventKind::TextDelta("hi".into()), content.clone()),
            (
                RunEventKind::ToolCallDelta(ToolCallDelta {
                    index: 0,
                    id: Some("c".into()),
                    name: Some("f".into()),
                    arguments_delta: String::new(),
                }),
                content,
            ),
            (RunEventKind::Usage(Usage::default()), AttemptFrame::NoEvent),
            (
                RunEventKind::Completed {
                    finish_reason: FinishReason::Stop,
                    usage: Some(Usage::default()),
                },
                AttemptFrame::Terminal,
            ),
            (
                RunEventKind::Failed(ExecutionFailure::new(FailureCode::ResponseStalled)),
                AttemptFrame::Terminal,
            ),
        ];
        for (kind, expected) in cases {
            assert_eq!(AttemptFrame::from_run_event(&kind), expected, "{kind:?}");
        }
    }

    #[test]
    fn a_stalled_tunnel_that_sent_only_its_head_and_empty_chunks_stays_recoverable() {
        let mut g = gate(2, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let frames = [
            ProviderTunnelFrame::Head {
                status: 200,
                headers: Vec::new(),
            },
            ProviderTunnelFrame::Body(Vec::new()),
        ];
        for frame in &frames {
            if let AttemptFrame::Event(event) = AttemptFrame::from_tunnel_frame(frame) {
                assert!(attempt(&mut g, Instant::from_millis(1), a1, event).is_empty());
            }
        }
        assert!(!g.is_committed());
        let out = attempt(
            &mut g,
            Instant::from_millis(2),
            a1,
            stall("p1", ProviderHealth::Available),
        );
        assert!(matches!(
            out.as_slice(),
            [
                GateOutput::CloseTransport { .. },
                GateOutput::Readmit { .. }
            ]
        ));
    }

    #[test]
    fn only_the_three_terminals_are_terminal_and_labels_are_closed() {
        let kind = GateFailure::Attempt(FailureCode::ProviderError);
        assert!(GateOutput::FailBeforeCommit { kind }.is_terminal());
        assert!(GateOutput::FailInStream { kind }.is_terminal());
        assert!(GateOutput::Finish.is_terminal());
        assert!(!GateOutput::Commit.is_terminal());
        for (e, label) in [
            (RecoveryEligibility::Eligible, "eligible"),
            (
                RecoveryEligibility::NotEligibleCommitted,
                "not_eligible_committed",
            ),
            (
                RecoveryEligibility::NotEligibleAttempts,
                "not_eligible_attempts",
            ),
            (
                RecoveryEligibility::NotEligibleBudget,
                "not_eligible_budget",
            ),
            (
                RecoveryEligibility::NotEligibleUnconfirmed,
                "not_eligible_unconfirmed",
            ),
        ] {
            assert_eq!(e.as_str(), label);
        }
        for (r, label) in [
            (RecoveryResult::Readmitted, "readmitted"),
            (RecoveryResult::Recovered, "recovered"),
            (RecoveryResult::Exhausted, "exhausted"),
            (RecoveryResult::Failed, "failed"),
            (RecoveryResult::Abandoned, "abandoned"),
        ] {
            assert_eq!(r.as_str(), label);
        }
        // Not started until the provider accepts the attempt.
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        assert!(!g.is_started());
        let _ = attempt(&mut g, Instant::ZERO, a1, AttemptEvent::Started);
        assert!(g.is_started());
    }

    #[test]
    fn started_without_content_does_not_commit() {
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        assert!(attempt(&mut g, Instant::from_millis(10), a1, AttemptEvent::Started).is_empty());
        assert!(g.is_started());
        assert!(!g.is_committed());
        // The stalled prefill stays recoverable.
        let out = attempt(
            &mut g,
            Instant::from_millis(20),
            a1,
            stall("p1", ProviderHealth::Unknown),
        );
        assert!(matches!(
            out.as_slice(),
            [
                GateOutput::CloseTransport { .. },
                GateOutput::Readmit { .. }
            ]
        ));
        let a2 = dispatch(&mut g, Instant::from_millis(30), "p2");
        assert_eq!(
            attempt(&mut g, Instant::from_millis(40), a2, AttemptEvent::Content),
            vec![GateOutput::Commit]
        );
        assert!(g.is_committed());
        // Later content is forwarded directly: no second commit.
        assert!(attempt(&mut g, Instant::from_millis(50), a2, AttemptEvent::Content).is_empty());
    }

    #[test]
    fn stall_before_commit_closes_transport_then_readmits_with_avoid_hint() {
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let out = attempt(
            &mut g,
            Instant::from_millis(5),
            a1,
            stall("p1", ProviderHealth::Unavailable),
        );
        assert_eq!(
            out,
            vec![
                GateOutput::CloseTransport { attempt: a1 },
                GateOutput::Readmit {
                    avoid_provider_id: pid("p1"),
                    allow_avoided_fallback: false,
                },
            ]
        );
        assert_eq!(g.readmissions(), 1);
        assert_eq!(g.current_attempt(), None);
        assert_eq!(
            drain_events(&mut g),
            vec![
                GateEvent::Eligibility(RecoveryEligibility::Eligible),
                GateEvent::Result(RecoveryResult::Readmitted),
            ]
        );
        // Stragglers of the closed attempt change nothing.
        assert_eq!(
            g.handle_input(
                Instant::from_millis(6),
                GateInput::Attempt {
                    attempt: a1,
                    event: AttemptEvent::Content
                }
            ),
            InputDisposition::Ignored(IgnoredInput::NotCurrentAttempt)
        );
        let a2 = dispatch(&mut g, Instant::from_millis(7), "p2");
        assert_ne!(a1, a2);
        assert_eq!(
            g.handle_input(
                Instant::from_millis(8),
                GateInput::Attempt {
                    attempt: a1,
                    event: AttemptEvent::Completed
                }
            ),
            InputDisposition::Ignored(IgnoredInput::NotCurrentAttempt)
        );
        assert!(drain(&mut g).is_empty());
        assert_eq!(
            attempt(&mut g, Instant::from_millis(9), a2, AttemptEvent::Content),
            vec![GateOutput::Commit]
        );
        assert_eq!(
            drain_events(&mut g),
            vec![GateEvent::Result(RecoveryResult::Recovered)]
        );
        assert_eq!(
            attempt(
                &mut g,
                Instant::from_millis(10),
                a2,
                AttemptEvent::Completed
            ),
            vec![GateOutput::Finish]
        );
        assert_eq!(g.end(), Some(GateEnd::Finished));
    }

    #[test]
    fn available_evidence_allows_avoided_fallback_others_do_not() {
        for (health, allowed) in [
            (ProviderHealth::Available, true),
            (ProviderHealth::Unavailable, false),
            (ProviderHealth::Unknown, false),
        ] {
            let mut g = gate(2, 60 * SECOND);
            let a1 = dispatch(&mut g, Instant::ZERO, "p1");
            let out = attempt(&mut g, Instant::from_millis(1), a1, stall("p1", health));
            assert_eq!(
                out.last(),
                Some(&GateOutput::Readmit {
                    avoid_provider_id: pid("p1"),
                    allow_avoided_fallback: allowed,
                }),
                "{health:?}"
            );
        }
    }

    #[test]
    fn stall_handoff_for_another_provider_is_not_confirmed() {
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let out = attempt(
            &mut g,
            Instant::from_millis(1),
            a1,
            stall("p9", ProviderHealth::Available),
        );
        assert_eq!(
            out,
            vec![GateOutput::FailBeforeCommit {
                kind: GateFailure::Attempt(FailureCode::ResponseStalled)
            }]
        );
        assert_eq!(
            drain_events(&mut g),
            vec![GateEvent::Eligibility(
                RecoveryEligibility::NotEligibleUnconfirmed
            )]
        );
    }

    #[test]
    fn stall_after_commit_ends_with_one_in_stream_error() {
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        assert_eq!(
            attempt(&mut g, Instant::from_millis(1), a1, AttemptEvent::Content),
            vec![GateOutput::Commit]
        );
        let out = attempt(
            &mut g,
            Instant::from_millis(2),
            a1,
            stall("p1", ProviderHealth::Available),
        );
        let kind = GateFailure::Attempt(FailureCode::ResponseStalled);
        assert_eq!(out, vec![GateOutput::FailInStream { kind }]);
        assert_eq!(
            g.end(),
            Some(GateEnd::Failed {
                kind,
                in_stream: true
            })
        );
        assert_eq!(g.readmissions(), 0);
        assert_eq!(
            drain_events(&mut g),
            vec![GateEvent::Eligibility(
                RecoveryEligibility::NotEligibleCommitted
            )]
        );
    }

    #[test]
    fn attempt_budget_is_shared_and_exhausts() {
        let mut g = gate(3, 600 * SECOND);
        let mut now = Instant::ZERO;
        for (i, provider) in ["p1", "p2", "p3"].into_iter().enumerate() {
            let a = dispatch(&mut g, now, provider);
            assert_eq!(a.get(), u32::try_from(i + 1).expect("small"));
            now += SECOND;
            let out = attempt(&mut g, now, a, stall(provider, ProviderHealth::Unknown));
            if i < 2 {
                assert_eq!(out.len(), 2, "re-admitted: {out:?}");
            } else {
                assert_eq!(
                    out,
                    vec![GateOutput::FailBeforeCommit {
                        kind: GateFailure::Attempt(FailureCode::ResponseStalled)
                    }]
                );
            }
        }
        assert_eq!(g.attempts(), 3);
        assert_eq!(g.readmissions(), 2);
        let events = drain_events(&mut g);
        assert_eq!(
            &events[events.len() - 2..],
            &[
                GateEvent::Eligibility(RecoveryEligibility::NotEligibleAttempts),
                GateEvent::Result(RecoveryResult::Exhausted),
            ]
        );
        assert_eq!(
            g.handle_input(
                now,
                GateInput::Dispatched {
                    provider_id: pid("p4")
                }
            ),
            InputDisposition::Ignored(IgnoredInput::Ended)
        );
        assert_eq!(g.attempts(), 3);
    }

    #[test]
    fn total_time_budget_expires() {
        let total = 10 * SECOND;
        let mut g = gate(3, total);
        let deadline = Instant::ZERO + total;
        assert_eq!(g.poll_timeout(), Some(deadline));
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        // A stall at the deadline is refused for budget, not re-admitted.
        let mut late = g.clone();
        let out = attempt(
            &mut late,
            deadline,
            a1,
            stall("p1", ProviderHealth::Available),
        );
        assert_eq!(out.len(), 1);
        assert!(drain_events(&mut late).contains(&GateEvent::Eligibility(
            RecoveryEligibility::NotEligibleBudget
        )));
        // Nothing fires before the deadline.
        g.handle_timeout(Instant::from_micros(deadline.as_micros() - 1));
        assert!(drain(&mut g).is_empty());
        g.handle_timeout(deadline);
        assert_eq!(
            drain(&mut g),
            vec![
                GateOutput::CancelRun { attempt: Some(a1) },
                GateOutput::FailBeforeCommit {
                    kind: GateFailure::BudgetExpired
                },
            ]
        );
        assert_eq!(g.poll_timeout(), None);

        // Committed: the same expiry ends in-stream.
        let mut g = gate(3, total);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let _ = attempt(&mut g, Instant::from_millis(1), a1, AttemptEvent::Content);
        g.handle_timeout(deadline + SECOND);
        assert_eq!(
            drain(&mut g),
            vec![
                GateOutput::CancelRun { attempt: Some(a1) },
                GateOutput::FailInStream {
                    kind: GateFailure::BudgetExpired
                },
            ]
        );

        // Expiry while re-admitting withdraws the pending admission.
        let mut g = gate(3, total);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let _ = attempt(
            &mut g,
            Instant::ZERO + SECOND,
            a1,
            stall("p1", ProviderHealth::Unknown),
        );
        let _ = drain_events(&mut g);
        g.handle_timeout(deadline);
        assert_eq!(
            drain(&mut g),
            vec![
                GateOutput::CancelRun { attempt: None },
                GateOutput::FailBeforeCommit {
                    kind: GateFailure::BudgetExpired
                },
            ]
        );
        assert_eq!(
            drain_events(&mut g),
            vec![GateEvent::Result(RecoveryResult::Exhausted)]
        );
    }

    #[test]
    fn client_disconnect_cancels_run_and_ends_gate() {
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let _ = attempt(&mut g, Instant::from_millis(1), a1, AttemptEvent::Content);
        assert_eq!(
            g.handle_input(Instant::from_millis(2), GateInput::ClientDisconnected),
            InputDisposition::Applied
        );
        assert_eq!(
            drain(&mut g),
            vec![GateOutput::CancelRun { attempt: Some(a1) }]
        );
        assert_eq!(g.end(), Some(GateEnd::ClientDisconnected));
        assert_eq!(g.poll_timeout(), None);
        for input in [
            GateInput::Attempt {
                attempt: a1,
                event: AttemptEvent::Completed,
            },
            GateInput::ClientDisconnected,
        ] {
            assert_eq!(
                g.handle_input(Instant::from_millis(3), input),
                InputDisposition::Ignored(IgnoredInput::Ended)
            );
        }
        g.handle_timeout(Instant::MAX);
        assert!(drain(&mut g).is_empty());

        // While queued: the pending admission is withdrawn.
        let mut g = gate(3, 60 * SECOND);
        let _ = g.handle_input(Instant::ZERO, GateInput::ClientDisconnected);
        assert_eq!(drain(&mut g), vec![GateOutput::CancelRun { attempt: None }]);
    }

    #[test]
    fn exactly_one_terminal_and_nothing_after() {
        let mut g = gate(2, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let out = attempt(
            &mut g,
            Instant::from_millis(1),
            a1,
            AttemptEvent::Failed {
                code: FailureCode::ProviderError,
            },
        );
        assert_eq!(
            out,
            vec![GateOutput::FailBeforeCommit {
                kind: GateFailure::Attempt(FailureCode::ProviderError)
            }]
        );
        let after = [
            GateInput::Attempt {
                attempt: a1,
                event: AttemptEvent::Completed,
            },
            GateInput::Attempt {
                attempt: a1,
                event: stall("p1", ProviderHealth::Available),
            },
            GateInput::Dispatched {
                provider_id: pid("p2"),
            },
            GateInput::AdmissionFailed(AdmissionFailure::QueueFull),
            GateInput::ClientDisconnected,
        ];
        for input in after {
            assert_eq!(
                g.handle_input(Instant::from_millis(2), input),
                InputDisposition::Ignored(IgnoredInput::Ended)
            );
        }
        g.handle_timeout(Instant::MAX);
        assert!(drain(&mut g).is_empty());

        // A completion without content still commits, then finishes once.
        let mut g = gate(2, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        assert_eq!(
            attempt(&mut g, Instant::from_millis(1), a1, AttemptEvent::Completed),
            vec![GateOutput::Commit, GateOutput::Finish]
        );
    }

    #[test]
    fn admission_failure_and_lost_transport_end_before_commit() {
        let mut g = gate(2, 60 * SECOND);
        let _ = g.handle_input(
            Instant::ZERO,
            GateInput::AdmissionFailed(AdmissionFailure::QueueFull),
        );
        assert_eq!(
            drain(&mut g),
            vec![GateOutput::FailBeforeCommit {
                kind: GateFailure::Admission(AdmissionFailure::QueueFull)
            }]
        );

        // With no attempt to spare, a lost transport ends the request.
        let mut g = gate(1, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        assert_eq!(
            g.handle_input(
                Instant::ZERO,
                GateInput::AdmissionFailed(AdmissionFailure::QueueTimeout)
            ),
            InputDisposition::Ignored(IgnoredInput::NotAdmitting)
        );
        assert_eq!(
            attempt(
                &mut g,
                Instant::from_millis(1),
                a1,
                AttemptEvent::TransportLost
            ),
            vec![GateOutput::FailBeforeCommit {
                kind: GateFailure::Attempt(FailureCode::TransportClosed)
            }]
        );
    }

    #[test]
    fn a_retryable_failure_or_lost_transport_before_commit_fails_over_r_fail_1() {
        for event in [
            AttemptEvent::TransportLost,
            AttemptEvent::FailedRetryable {
                code: FailureCode::NodeOverloaded,
            },
        ] {
            let mut g = gate(2, 60 * SECOND);
            let a1 = dispatch(&mut g, Instant::ZERO, "p1");
            assert_eq!(
                attempt(&mut g, Instant::from_millis(1), a1, event.clone()),
                vec![
                    GateOutput::CloseTransport { attempt: a1 },
                    GateOutput::Readmit {
                        avoid_provider_id: ProviderId::new("p1"),
                        allow_avoided_fallback: false,
                    },
                ],
                "{event:?}"
            );
            assert_eq!(
                drain_events(&mut g),
                vec![GateEvent::Result(RecoveryResult::Readmitted)]
            );
            // The second attempt has none to spare: the failure ends it.
            let a2 = dispatch(&mut g, Instant::from_millis(2), "p2");
            let out = attempt(&mut g, Instant::from_millis(3), a2, event);
            assert!(
                matches!(out.as_slice(), [GateOutput::FailBeforeCommit { .. }]),
                "{out:?}"
            );
        }
    }

    #[test]
    fn a_readmission_with_nowhere_to_go_ends_with_the_last_attempts_failure_r_fail_1() {
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let failed = AttemptEvent::FailedRetryable {
            code: FailureCode::ProviderError,
        };
        let out = attempt(&mut g, Instant::from_millis(1), a1, failed);
        assert!(
            matches!(out.last(), Some(GateOutput::Readmit { .. })),
            "{out:?}"
        );
        let _ = g.handle_input(
            Instant::from_millis(2),
            GateInput::AdmissionFailed(AdmissionFailure::NoEligibleProvider),
        );
        let out: Vec<_> = std::iter::from_fn(|| g.poll_output()).collect();
        assert_eq!(
            out,
            vec![GateOutput::FailBeforeCommit {
                kind: GateFailure::Attempt(FailureCode::ProviderError)
            }]
        );
        // A first admission's refusal is the admission's own.
        let mut g = gate(3, 60 * SECOND);
        let _ = g.handle_input(
            Instant::ZERO,
            GateInput::AdmissionFailed(AdmissionFailure::NoEligibleProvider),
        );
        let out: Vec<_> = std::iter::from_fn(|| g.poll_output()).collect();
        assert_eq!(
            out,
            vec![GateOutput::FailBeforeCommit {
                kind: GateFailure::Admission(AdmissionFailure::NoEligibleProvider)
            }]
        );
    }

    #[test]
    fn a_non_retryable_failure_after_commit_or_without_failover_never_readmits_r_fail_1() {
        // Not retryable (its provider call may still run, R-WD-4).
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let out = attempt(
            &mut g,
            Instant::from_millis(1),
            a1,
            AttemptEvent::Failed {
                code: FailureCode::ProviderError,
            },
        );
        assert!(
            matches!(out.as_slice(), [GateOutput::FailBeforeCommit { .. }]),
            "{out:?}"
        );
        // After commit.
        let mut g = gate(3, 60 * SECOND);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let _ = attempt(&mut g, Instant::from_millis(1), a1, AttemptEvent::Content);
        let out = attempt(
            &mut g,
            Instant::from_millis(2),
            a1,
            AttemptEvent::TransportLost,
        );
        assert!(
            matches!(out.as_slice(), [GateOutput::FailInStream { .. }]),
            "{out:?}"
        );
        // A pool of one: nowhere to fail over to.
        let mut g = gate(3, 60 * SECOND);
        g.set_failover(false);
        let a1 = dispatch(&mut g, Instant::ZERO, "p1");
        let out = attempt(
            &mut g,
            Instant::from_millis(1),
            a1,
            AttemptEvent::TransportLost,
        );
        assert!(
            matches!(out.as_slice(), [GateOutput::FailBeforeCommit { .. }]),
            "{out:?}"
        );
    }

    #[test]
    fn only_retryable_non_client_failures_may_fail_over_r_fail_1() {
        use iop_wire::ExecutionFailure;
        let failure = |code, retryable, http_status| {
            let mut f = ExecutionFailure::new(code);
            f.retryable = retryable;
            f.http_status = http_status;
            f
        };
        for (f, expected) in [
            (failure(FailureCode::NodeOverloaded, true, None), true),
            (failure(FailureCode::ProviderUnreachable, true, None), true),
            (failure(FailureCode::ProviderError, true, Some(503)), true),
            (failure(FailureCode::ProviderError, true, Some(429)), true),
            (failure(FailureCode::ProviderError, true, Some(400)), false),
            (failure(FailureCode::ProviderError, false, Some(503)), false),
            (failure(FailureCode::NodeOverloaded, false, None), false),
            (failure(FailureCode::InvalidRequest, true, None), false),
            (failure(FailureCode::CredentialRejected, true, None), false),
            (failure(FailureCode::Canceled, true, None), false),
            (failure(FailureCode::DeadlineExceeded, true, None), false),
        ] {
            assert_eq!(failure_may_fail_over(&f), expected, "{f:?}");
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Advance(u64),
        Timeout,
        Dispatch(u8),
        AdmissionFailed,
        /// An attempt event; `stale` targets the previous attempt.
        Attempt {
            stale: bool,
            event: AttemptEvent,
        },
        /// A confirmed stall, usually about the dispatched provider.
        Stall {
            stale: bool,
            same_provider: bool,
            health: ProviderHealth,
        },
        ClientDisconnected,
    }

    fn health() -> impl Strategy<Value = ProviderHealth> {
        prop_oneof![
            Just(ProviderHealth::Available),
            Just(ProviderHealth::Unavailable),
            Just(ProviderHealth::Unknown),
        ]
    }

    fn attempt_event() -> impl Strategy<Value = AttemptEvent> {
        prop_oneof![
            4 => Just(AttemptEvent::Started),
            2 => Just(AttemptEvent::Content),
            1 => Just(AttemptEvent::Completed),
            1 => Just(AttemptEvent::Failed { code: FailureCode::ProviderError }),
            1 => Just(AttemptEvent::Failed { code: FailureCode::ResponseStalled }),
            1 => Just(AttemptEvent::TransportLost),
            1 => Just(AttemptEvent::FailedRetryable { code: FailureCode::NodeOverloaded }),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..10_000).prop_map(Op::Advance),
            1 => Just(Op::Timeout),
            6 => (0u8..3).prop_map(Op::Dispatch),
            1 => Just(Op::AdmissionFailed),
            4 => (proptest::bool::weighted(0.2), attempt_event())
                .prop_map(|(stale, event)| Op::Attempt { stale, event }),
            6 => (proptest::bool::weighted(0.2), proptest::bool::weighted(0.9), health())
                .prop_map(|(stale, same_provider, health)| Op::Stall { stale, same_provider, health }),
            1 => Just(Op::ClientDisconnected),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

        #[test]
        fn gate_invariants_hold_for_any_input_sequence(
            max_attempts in 1u32..=4,
            total_ms in 1u64..60_000,
            ops in proptest::collection::vec(op(), 0..48),
        ) {
            let budget = GateBudget::new(max_attempts, Duration::from_millis(total_ms)).expect("valid");
            let mut g = StreamGate::new(Instant::ZERO, budget);
            let mut now = Instant::ZERO;
            let mut all: Vec<GateOutput> = Vec::new();
            let mut events: Vec<GateEvent> = Vec::new();
            let mut ended_at: Option<usize> = None;
            let mut last_attempt: Option<AttemptId> = None;
            let mut dispatched = ProviderId::new("p0");
            let mut failovers = 0usize;
            let target_of = |g: &StreamGate, last: Option<AttemptId>, stale: bool| match g.current_attempt().or(last) {
                Some(a) if stale && a.get() > 1 => AttemptId(a.get() - 1),
                Some(a) => a,
                None => AttemptId(1),
            };
            for op in ops {
                match op {
                    Op::Advance(ms) => now += Duration::from_millis(ms),
                    Op::Timeout => g.handle_timeout(now),
                    Op::Dispatch(p) => {
                        let provider_id = ProviderId::new(format!("p{p}"));
                        if g.handle_input(now, GateInput::Dispatched { provider_id: provider_id.clone() }) == InputDisposition::Applied {
                            dispatched = provider_id;
                        }
                    }
                    Op::AdmissionFailed => {
                        let _ = g.handle_input(now, GateInput::AdmissionFailed(AdmissionFailure::NoEligibleProvider));
                    }
                    Op::Attempt { stale, event } => {
                        let attempt = target_of(&g, last_attempt, stale);
                        let failing = matches!(
                            event,
                            AttemptEvent::TransportLost | AttemptEvent::FailedRetryable { .. }
                        );
                        let before = g.readmissions();
                        let _ = g.handle_input(now, GateInput::Attempt { attempt, event });
                        if failing && g.readmissions() > before {
                            failovers += 1;
                        }
                    }
                    Op::Stall { stale, same_provider, health } => {
                        let attempt = target_of(&g, last_attempt, stale);
                        let provider_id = if same_provider { dispatched.clone() } else { ProviderId::new("elsewhere") };
                        let event = AttemptEvent::Stalled(ConfirmedStall { provider_id, health });
                        let _ = g.handle_input(now, GateInput::Attempt { attempt, event });
                    }
                    Op::ClientDisconnected => {
                        let _ = g.handle_input(now, GateInput::ClientDisconnected);
                    }
                }
                if let Some(a) = g.current_attempt() {
                    last_attempt = Some(a);
                }
                let out = drain(&mut g);
                prop_assert!(ended_at.is_none() || out.is_empty(), "output after the end: {out:?}");
                all.extend(out);
                events.extend(drain_events(&mut g));
                if g.end().is_some() && ended_at.is_none() {
                    ended_at = Some(all.len());
                }
                prop_assert!(g.attempts() <= max_attempts);
                prop_assert_eq!(g.poll_timeout().is_none(), g.end().is_some());
            }

            // At most one terminal, and it is the last output.
            let terminals: Vec<usize> = all.iter().enumerate().filter(|(_, o)| o.is_terminal()).map(|(i, _)| i).collect();
            prop_assert!(terminals.len() <= 1, "terminals: {all:?}");
            if let Some(&t) = terminals.first() {
                prop_assert_eq!(t, all.len() - 1);
                prop_assert!(matches!(g.end(), Some(GateEnd::Finished | GateEnd::Failed { .. })), "end: {:?}", g.end());
            }
            if g.end() == Some(GateEnd::ClientDisconnected) {
                prop_assert!(terminals.is_empty());
                prop_assert!(matches!(all.last(), Some(GateOutput::CancelRun { .. })), "{all:?}");
            }
            // CloseTransport immediately precedes every Readmit, and vice versa.
            for (i, o) in all.iter().enumerate() {
                match o {
                    GateOutput::CloseTransport { .. } => {
                        prop_assert!(matches!(all.get(i + 1), Some(GateOutput::Readmit { .. })), "{all:?}");
                    }
                    GateOutput::Readmit { .. } => {
                        prop_assert!(i > 0 && matches!(all[i - 1], GateOutput::CloseTransport { .. }), "{all:?}");
                    }
                    _ => {}
                }
            }
            // No Readmit after Commit; at most one Commit.
            let commits: Vec<usize> = all.iter().enumerate().filter(|(_, o)| **o == GateOutput::Commit).map(|(i, _)| i).collect();
            prop_assert!(commits.len() <= 1);
            if let Some(&c) = commits.first() {
                prop_assert!(!all[c..].iter().any(|o| matches!(o, GateOutput::Readmit { .. })), "readmit after commit: {all:?}");
                prop_assert!(!all[c..].iter().any(|o| matches!(o, GateOutput::FailBeforeCommit { .. })), "HTTP error after commit: {all:?}");
            } else {
                prop_assert!(!all.iter().any(|o| matches!(o, GateOutput::FailInStream { .. } | GateOutput::Finish)), "stream end without commit: {all:?}");
            }
            // The re-admission counter matches the outputs and the results.
            let readmits = all.iter().filter(|o| matches!(o, GateOutput::Readmit { .. })).count();
            prop_assert_eq!(readmits, usize::try_from(g.readmissions()).expect("small"));
            let readmitted = events.iter().filter(|e| **e == GateEvent::Result(RecoveryResult::Readmitted)).count();
            prop_assert_eq!(readmitted, readmits);
            let eligible = events.iter().filter(|e| **e == GateEvent::Eligibility(RecoveryEligibility::Eligible)).count();
            // Every re-admission is an eligible stall or a failover (R-FAIL-1).
            prop_assert_eq!(eligible + failovers, readmits);
            // At most one recovery outcome; exactly one once a re-admitted gate ended.
            let outcomes = events.iter().filter(|e| matches!(e, GateEvent::Result(r) if *r != RecoveryResult::Readmitted)).count();
            prop_assert!(outcomes <= 1, "{events:?}");
            if g.end().is_some() && readmits > 0 {
                prop_assert_eq!(outcomes, 1, "{:?}", events);
            }
        }
    }

    fn tunnel_frame() -> impl Strategy<Value = ProviderTunnelFrame> {
        prop_oneof![
            (100u16..600).prop_map(|status| ProviderTunnelFrame::Head {
                status,
                headers: Vec::new(),
            }),
            proptest::collection::vec(any::<u8>(), 0..3).prop_map(ProviderTunnelFrame::Body),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// R-GATE-2 through the classifier: a tunnel commits exactly at its
        /// first non-empty body frame, whatever heads and empty chunks
        /// come before it.
        #[test]
        fn tunnel_commits_exactly_at_its_first_non_empty_body(
            frames in proptest::collection::vec(tunnel_frame(), 0..12),
        ) {
            let mut g = gate(1, 60 * SECOND);
            let a1 = dispatch(&mut g, Instant::ZERO, "p1");
            let first_content = frames
                .iter()
                .position(|f| matches!(f, ProviderTunnelFrame::Body(b) if !b.is_empty()));
            for (i, frame) in frames.iter().enumerate() {
                let out = match AttemptFrame::from_tunnel_frame(frame) {
                    AttemptFrame::Event(event) => attempt(&mut g, Instant::from_millis(1), a1, event),
                    AttemptFrame::NoEvent => Vec::new(),
                    AttemptFrame::Terminal => unreachable!("no terminal frames generated"),
                };
                prop_assert_eq!(out.contains(&GateOutput::Commit), Some(i) == first_content, "frame {}: {:?}", i, frame);
                prop_assert_eq!(g.is_committed(), first_content.is_some_and(|c| c <= i));
            }
        }
    }
}
