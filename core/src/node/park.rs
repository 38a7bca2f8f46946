//! A durable run's life without its Edge connection (SPEC §6: R-PARK-1,
//! R-PARK-2), on the node.
//!
//! A run that writes a durable response keeps every frame it produced
//! until the Edge acknowledges it durable (the Edge acks a frame once the
//! journal holds what it carried). When the run's connection is lost the
//! run is *parked*: its provider call goes on, its frames are kept, for at
//! most the park grace. An Edge adopts it by asking to resume after the
//! last frame its journal holds; the run then replays the frames after it
//! and goes on live. Every decision is here:
//!
//! * frames are numbered 1, 2, 3, ... for the run's whole life (across
//!   connections), so a resume point means the same frame everywhere;
//! * the kept frames are bounded in bytes: past the bound the run stops
//!   reading from its provider ([`RunPark::wants_provider`]), it never drops
//!   a frame (R-PARK-1, R-LIM-4);
//! * a parked run not adopted within the grace is cancelled
//!   ([`ParkOutput::Expired`]);
//! * a run is attached to at most one connection: an adoption of a run that
//!   is attached is refused, and so is one asking for frames the run no
//!   longer has or never produced (R-PARK-2);
//! * an adoption the new connection then refuses
//!   ([`RunPark::adoption_aborted`]) returns the run to the grace it had:
//!   the grace runs from the loss, however many adoptions fail (R-PARK-1);
//! * an adoption's stall timeout is validated as a fresh run's
//!   ([`adoption_stall_timeout`]);
//! * a run is over when its terminal frame is acknowledged, or when it
//!   expires.
//!
//! Beside the machine, the rules the shell would otherwise write itself:
//! the bytes a frame counts against the bound ([`frame_bytes`]), which end
//! of the Edge's side of the stream parks the run and which cancels it
//! ([`EdgeSignal::verdict`], R-DISC-1), which runs a report to an Edge names
//! ([`select_reports`], R-PARK-2) and which hold provider capacity while
//! without a connection ([`parked_capacity`]).
//!
//! The machine holds the frames (of any type `F`, with their sizes); the
//! shell keeps one per durable run, feeds it inputs with `now`, and carries
//! out [`RunPark::poll_output`].

use std::collections::VecDeque;
use std::time::Duration;

use iop_wire::{AdapterKind, ParkedRun, RunEventKind};

use crate::node::capacity::ParkedRuns;
use crate::node::watchdog::effective_stall_timeout;
use crate::time::Instant;

/// The default park grace (R-PARK-1).
pub const DEFAULT_PARK_GRACE: Duration = Duration::from_millis(30_000);

/// The longest park grace a request may ask for.
pub const MAX_PARK_GRACE: Duration = Duration::from_millis(600_000);

/// The default bound of the frames one run keeps.
pub const DEFAULT_MAX_KEPT_BYTES: usize = 8 * 1024 * 1024;

/// Bytes every frame counts against the kept-bytes bound besides its
/// payload (its number, type and framing), so that no frame is free.
pub const FRAME_OVERHEAD_BYTES: usize = 64;

/// The bytes `kind` counts against a run's kept-bytes bound
/// ([`RunPark::new`]'s `max_kept_bytes`, R-PARK-1): its variable-length
/// payload (text, tool-call fragments, embedding values, log
/// probabilities) plus [`FRAME_OVERHEAD_BYTES`].
pub fn frame_bytes(kind: &RunEventKind) -> usize {
    const F32_BYTES: usize = std::mem::size_of::<f32>();
    let payload = match kind {
        RunEventKind::TextDelta(t) | RunEventKind::ReasoningDelta(t) => t.len(),
        RunEventKind::ToolCallDelta(d) => {
            d.arguments_delta.len()
                + d.id.as_ref().map_or(0, String::len)
                + d.name.as_ref().map_or(0, String::len)
        }
        RunEventKind::Embedding(e) => e.values.len() * F32_BYTES,
        RunEventKind::Logprobs(tokens) => tokens
            .iter()
            .map(|t| {
                t.token.len()
                    + F32_BYTES
                    + t.top
                        .iter()
                        .map(|(alt, _)| alt.len() + F32_BYTES)
                        .sum::<usize>()
            })
            .sum(),
        RunEventKind::Started { session_id } => session_id.len(),
        RunEventKind::Usage(_) | RunEventKind::Completed { .. } | RunEventKind::Failed(_) => 0,
    };
    payload + FRAME_OVERHEAD_BYTES
}

/// The park grace a request's `grace_ms` means: `0` is the default, larger
/// than [`MAX_PARK_GRACE`] is cut to it.
pub fn effective_park_grace(grace_ms: u64) -> Duration {
    if grace_ms == 0 {
        DEFAULT_PARK_GRACE
    } else {
        Duration::from_millis(grace_ms).min(MAX_PARK_GRACE)
    }
}

/// Where a durable run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParkState {
    /// On a connection: its frames go to the Edge as they come.
    Attached,
    /// Without a connection since it lost its own, until `until`.
    Parked {
        /// When the grace ends.
        until: Instant,
    },
    /// Over: its terminal was acknowledged, or its grace ended.
    Over,
}

/// Why an adoption was refused (R-PARK-2).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum AdoptRefusal {
    /// The run is on a connection already: it is handed to one at a time.
    #[error("the run is attached to another connection")]
    Attached,
    /// The run is over.
    #[error("the run is over")]
    Over,
    /// The frames after the resume point were acknowledged and dropped:
    /// the asking Edge's journal is behind what another Edge acknowledged.
    #[error("frames after {resume_after} were already dropped (first kept: {first_kept})")]
    Gap {
        /// The asked resume point.
        resume_after: u64,
        /// The first frame still kept.
        first_kept: u64,
    },
    /// The resume point is past every frame the run produced.
    #[error("frame {resume_after} was never produced (last: {last})")]
    Ahead {
        /// The asked resume point.
        resume_after: u64,
        /// The last frame produced.
        last: u64,
    },
    /// The request's `response_stall_timeout_ms` is one a fresh run is
    /// refused for (SPEC §3); the Edge is at fault.
    #[error("response_stall_timeout_ms {stall_timeout_ms} is out of range")]
    InvalidStallTimeout {
        /// The refused wire value.
        stall_timeout_ms: u64,
    },
}

/// The stall timeout an adopting connection watches the run with: the
/// adoption request's `response_stall_timeout_ms`, under the rule a fresh
/// run's is (`0` the default, out of range refused, SPEC §3). An adoption
/// asking for one a fresh run would be refused for is refused; it does not
/// fall back to the run's old timeout.
pub fn adoption_stall_timeout(wire_ms: u64) -> Result<Duration, AdoptRefusal> {
    effective_stall_timeout(wire_ms).map_err(|e| AdoptRefusal::InvalidStallTimeout {
        stall_timeout_ms: e.stall_timeout_ms,
    })
}

/// How the Edge's side of a durable run's stream ended. A closed set: the
/// shell classifies its transport's report into one of these, and
/// [`EdgeSignal::verdict`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeSignal {
    /// The Edge finished its side cleanly (FIN) without cancelling: its
    /// request is over there, or the Edge is going away.
    Finished,
    /// The whole connection is gone (closed by either side, timed out).
    ConnectionLost,
    /// The Edge reset its side of the stream.
    Reset,
    /// The Edge stopped reading the Node's side of the stream.
    Stopped,
    /// Anything else: bytes that are not a frame, or the stream broke.
    Broken,
}

/// What a durable run does when its Edge's side ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeVerdict {
    /// Keep the run for another connection ([`RunPark::detached`]).
    Park,
    /// The Edge cancelled the response: end the run
    /// ([`RunPark::cancelled`]) and its provider call.
    Cancel,
}

impl EdgeSignal {
    /// Losing the connection, or a clean end, parks the run (R-DISC-1,
    /// R-PARK-1); only the Edge's explicit reset or stop, or a stream it
    /// broke, cancels it.
    pub fn verdict(self) -> EdgeVerdict {
        match self {
            EdgeSignal::Finished | EdgeSignal::ConnectionLost => EdgeVerdict::Park,
            EdgeSignal::Reset | EdgeSignal::Stopped | EdgeSignal::Broken => EdgeVerdict::Cancel,
        }
    }
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParkOutput {
    /// The grace ended without an adoption: cancel the provider call and
    /// forget the run (R-PARK-1).
    Expired,
    /// The terminal frame was acknowledged: the run is done.
    Done,
}

/// Which durable runs a report to an Edge names (R-PARK-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportScope {
    /// At registration: every run that is not over. A run still attached
    /// to a connection that is going away is named too (an adoption
    /// detaches it first).
    Registration,
    /// On a live connection, when a run parks: the runs parked now.
    Live,
}

impl ReportScope {
    /// Whether a run in `state` is named.
    pub fn includes(self, state: ParkState) -> bool {
        match self {
            ReportScope::Registration => state != ParkState::Over,
            ReportScope::Live => matches!(state, ParkState::Parked { .. }),
        }
    }
}

/// The report `scope` makes of `runs` (each with its state): the runs it
/// includes, ordered by run key, then response id (two Edges may hand out
/// one key, R-MULTI-1), at most [`iop_wire::MAX_PARKED_RUNS`] (the wire
/// bound): the first ones in that order. The order is total, so which runs
/// are left out past the bound is deterministic; a run left out is not
/// offered for adoption by this report and expires after its grace unless
/// a later report names it.
pub fn select_reports<'a>(
    scope: ReportScope,
    runs: impl IntoIterator<Item = (ParkState, &'a ParkedRun)>,
) -> Vec<ParkedRun> {
    let mut named: Vec<&ParkedRun> = runs
        .into_iter()
        .filter(|(state, _)| scope.includes(*state))
        .map(|(_, run)| run)
        .collect();
    named.sort_unstable_by(|a, b| (a.key, &a.response_id).cmp(&(b.key, &b.response_id)));
    named.truncate(iop_wire::MAX_PARKED_RUNS);
    named.into_iter().cloned().collect()
}

/// The durable runs of `runs` (each with its state) that hold provider
/// capacity outside every connection's count, in all and on
/// `adapter`/`target`: the parked ones (R-PARK-1). An attached run is
/// counted by its connection, an over one holds nothing.
pub fn parked_capacity<'a>(
    adapter: AdapterKind,
    target: &str,
    runs: impl IntoIterator<Item = (ParkState, &'a ParkedRun)>,
) -> ParkedRuns {
    let mut counts = ParkedRuns::default();
    for (_, run) in runs
        .into_iter()
        .filter(|(state, _)| matches!(state, ParkState::Parked { .. }))
    {
        counts.total += 1;
        if run.adapter == adapter && run.target == target {
            counts.on_target += 1;
        }
    }
    counts
}

/// A summary of a parked run, for the report at registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParkSummary {
    /// The first frame still kept (`last + 1` when none is).
    pub first_kept: u64,
    /// The last frame produced (0: none).
    pub last: u64,
    /// The terminal frame is among the produced ones.
    pub ended: bool,
}

/// One durable run's frames and attachment (see the module docs).
#[derive(Debug)]
pub struct RunPark<F> {
    grace: Duration,
    max_kept_bytes: usize,
    /// Kept frames: number, frame, counted bytes.
    kept: VecDeque<(u64, F, usize)>,
    kept_bytes: usize,
    /// The last frame produced.
    last: u64,
    /// The last frame acknowledged durable.
    acked: u64,
    /// The number of the terminal frame, once produced.
    terminal: Option<u64>,
    state: ParkState,
    /// The grace end of the park an adoption just took the run from, until
    /// a frame is produced or acked or the run detaches or is cancelled:
    /// [`RunPark::adoption_aborted`] returns it there.
    adopted_from: Option<Instant>,
    outputs: VecDeque<ParkOutput>,
}

impl<F: Clone> RunPark<F> {
    /// A run attached to the connection it started on.
    pub fn new(grace: Duration, max_kept_bytes: usize) -> Self {
        RunPark {
            grace,
            max_kept_bytes: max_kept_bytes.max(1),
            kept: VecDeque::new(),
            kept_bytes: 0,
            last: 0,
            acked: 0,
            terminal: None,
            state: ParkState::Attached,
            adopted_from: None,
            outputs: VecDeque::new(),
        }
    }

    /// Where the run is.
    pub fn state(&self) -> ParkState {
        self.state
    }

    /// The summary a registration reports.
    pub fn summary(&self) -> ParkSummary {
        ParkSummary {
            first_kept: self.kept.front().map_or(self.last + 1, |(n, ..)| *n),
            last: self.last,
            ended: self.terminal.is_some(),
        }
    }

    /// Whether the shell may read the provider's next output: the kept
    /// frames are under their bound and the run is not over. A run past
    /// its bound waits (back-pressure on the provider), it drops nothing.
    pub fn wants_provider(&self) -> bool {
        self.state != ParkState::Over
            && self.terminal.is_none()
            && self.kept_bytes < self.max_kept_bytes
    }

    /// The provider produced `frame` (`bytes` counted against the bound);
    /// `terminal` if it is the run's last. Returns its number. The frame is
    /// kept until acknowledged; the shell sends it now if attached.
    pub fn produced(&mut self, frame: F, bytes: usize, terminal: bool) -> u64 {
        self.adopted_from = None;
        self.last += 1;
        let n = self.last;
        if terminal {
            self.terminal = Some(n);
        }
        self.kept.push_back((n, frame, bytes));
        self.kept_bytes += bytes;
        n
    }

    /// The Edge acknowledged every frame through `through` as durable:
    /// they are dropped. An ack past the last frame counts only up to it.
    pub fn acked(&mut self, through: u64) {
        self.adopted_from = None;
        self.drop_through(through);
    }

    fn drop_through(&mut self, through: u64) {
        let through = through.min(self.last);
        if through <= self.acked {
            return;
        }
        self.acked = through;
        while let Some((n, _, bytes)) = self.kept.front() {
            if *n > through {
                break;
            }
            self.kept_bytes -= *bytes;
            self.kept.pop_front();
        }
        if self.terminal.is_some_and(|t| t <= through) && self.state != ParkState::Over {
            self.state = ParkState::Over;
            self.outputs.push_back(ParkOutput::Done);
        }
    }

    /// The run's connection was lost: it parks for the grace (R-PARK-1).
    pub fn detached(&mut self, now: Instant) {
        self.adopted_from = None;
        if self.state == ParkState::Attached {
            self.state = ParkState::Parked {
                until: now.saturating_add(self.grace),
            };
        }
    }

    /// An Edge asks to adopt the run and resume after frame
    /// `resume_after` (the last its journal holds): the frames to replay,
    /// in order, or why not (R-PARK-2). On success the run is attached and
    /// every frame through `resume_after` counts as acknowledged. If the
    /// adopting connection then refuses the run, call
    /// [`Self::adoption_aborted`] next. An adoption at or after the grace's
    /// end is refused as [`AdoptRefusal::Over`] and the run expires then,
    /// even if the driver's timer has not fired yet (R-PARK-1: kept for the
    /// grace, not for as long as the driver is late).
    pub fn adopt(
        &mut self,
        now: Instant,
        resume_after: u64,
    ) -> Result<Vec<(u64, F)>, AdoptRefusal> {
        self.handle_timeout(now);
        let until = match self.state {
            ParkState::Attached => return Err(AdoptRefusal::Attached),
            ParkState::Over => return Err(AdoptRefusal::Over),
            ParkState::Parked { until } => until,
        };
        if resume_after > self.last {
            return Err(AdoptRefusal::Ahead {
                resume_after,
                last: self.last,
            });
        }
        let first_kept = self.summary().first_kept;
        if resume_after + 1 < first_kept {
            return Err(AdoptRefusal::Gap {
                resume_after,
                first_kept,
            });
        }
        #[cfg(feature = "planted-bugs")]
        let resume_after = planted_resume_point(resume_after);
        self.state = ParkState::Attached;
        self.drop_through(resume_after);
        if self.state == ParkState::Over {
            // The terminal itself was already in the Edge's journal.
            self.adopted_from = None;
            return Ok(Vec::new());
        }
        self.adopted_from = Some(until);
        Ok(self
            .kept
            .iter()
            .filter(|(n, ..)| *n > resume_after)
            .map(|(n, f, _)| (*n, f.clone()))
            .collect())
    }

    /// The connection an accepted [`Self::adopt`] attached the run to
    /// refused it (its link would not start it): the run is parked again
    /// until the grace end it had, not for a fresh grace, so refused
    /// adoptions never extend the grace past the loss (R-PARK-1). The
    /// frames the adoption counted as acknowledged stay dropped (the
    /// record's journal holds them). Called after the adoption took (a
    /// frame was produced or acked since), it is a loss at `now`
    /// ([`Self::detached`]).
    pub fn adoption_aborted(&mut self, now: Instant) {
        match self.adopted_from.take() {
            Some(until) if self.state == ParkState::Attached => {
                self.state = ParkState::Parked { until };
            }
            _ => self.detached(now),
        }
    }

    /// The run was cancelled (by its Edge, or its provider call could not
    /// go on): it is over without a terminal of its own.
    pub fn cancelled(&mut self) {
        self.adopted_from = None;
        self.state = ParkState::Over;
        self.kept.clear();
        self.kept_bytes = 0;
    }

    /// When to call [`Self::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            ParkState::Parked { until } => Some(until),
            _ => None,
        }
    }

    /// Time passed: a parked run whose grace ended expires.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let ParkState::Parked { until } = self.state
            && now >= until
        {
            self.state = ParkState::Over;
            self.kept.clear();
            self.kept_bytes = 0;
            self.outputs.push_back(ParkOutput::Expired);
        }
    }

    /// The next thing to do, if any.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<ParkOutput> {
        self.outputs.pop_front()
    }
}

/// A frame replayed to the connection that adopts a run (R-PARK-2). A
/// stall terminal made on the run's old connection carries that
/// connection's observation sequence number and probe evidence; on the
/// new connection its Edge would read them as the new generation's
/// (R-SEQ-1, R-OVL-2) and could lower the provider with a number the new
/// connection's answers never pass. So it is replayed as a stall without
/// evidence (`unknown`, which never lowers), everything else as it was.
pub fn replayed(mut kind: iop_wire::RunEventKind) -> iop_wire::RunEventKind {
    if let iop_wire::RunEventKind::Failed(f) = &mut kind
        && f.code == iop_wire::FailureCode::ResponseStalled
    {
        f.health_observation_seq = None;
        f.provider_health = Some(iop_wire::ProviderHealth::Unknown);
        f.liveness_classification =
            Some(iop_wire::ProviderHealth::Unknown.liveness_classification());
    }
    kind
}

/// Planted `ResumeFromZero` and `ReplaySkipsAFrame`: the replay's
/// filter starts at frame 0, or one frame late (see [`crate::planted`]).
#[cfg(feature = "planted-bugs")]
fn planted_resume_point(resume_after: u64) -> u64 {
    use crate::planted::{PlantedBug, in_thread};
    if in_thread(PlantedBug::ResumeFromZero) {
        0
    } else if in_thread(PlantedBug::ReplaySkipsAFrame) {
        resume_after + 1
    } else {
        resume_after
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// R-SEQ-1, R-OVL-2: a replayed stall terminal loses the old
    /// connection's evidence; other frames are replayed as they were.
    #[test]
    fn a_replayed_stall_terminal_carries_no_evidence_of_the_old_connection() {
        use iop_wire::{ExecutionFailure, FailureCode, ProviderHealth, RunEventKind};
        let stall = ExecutionFailure {
            provider_health: Some(ProviderHealth::Unavailable),
            liveness_classification: Some(ProviderHealth::Unavailable.liveness_classification()),
            health_observation_seq: Some(41),
            ..ExecutionFailure::new(FailureCode::ResponseStalled)
        };
        let RunEventKind::Failed(f) = replayed(RunEventKind::Failed(stall)) else {
            panic!("still a failure");
        };
        assert_eq!(f.code, FailureCode::ResponseStalled);
        assert_eq!(f.health_observation_seq, None);
        assert_eq!(f.provider_health, Some(ProviderHealth::Unknown));
        let other = RunEventKind::Failed(ExecutionFailure::new(FailureCode::ProviderError));
        assert_eq!(replayed(other.clone()), other);
        let text = RunEventKind::TextDelta("tok1".into());
        assert_eq!(replayed(text.clone()), text);
    }

    const GRACE: Duration = Duration::from_secs(30);

    fn park() -> RunPark<&'static str> {
        RunPark::new(GRACE, 100)
    }

    #[test]
    fn frames_are_numbered_for_the_runs_life_and_kept_until_acked() {
        let mut p = park();
        assert_eq!(p.produced("a", 10, false), 1);
        assert_eq!(p.produced("b", 10, false), 2);
        p.acked(1);
        assert_eq!(
            p.summary(),
            ParkSummary {
                first_kept: 2,
                last: 2,
                ended: false
            }
        );
        p.acked(7);
        assert_eq!(
            p.summary().first_kept,
            3,
            "an ack counts up to the last frame"
        );
        assert_eq!(p.produced("c", 10, false), 3);
    }

    #[test]
    fn r_park_1_a_full_buffer_stops_reading_the_provider_and_drops_nothing() {
        let mut p = park();
        for _ in 0..10 {
            assert!(p.wants_provider());
            p.produced("x", 10, false);
        }
        assert!(!p.wants_provider(), "at the bound");
        assert_eq!(p.summary().first_kept, 1, "nothing dropped");
        p.acked(5);
        assert!(p.wants_provider(), "acks make room");
    }

    #[test]
    fn r_park_1_a_parked_run_not_adopted_within_the_grace_expires() {
        let mut p = park();
        p.produced("a", 1, false);
        let t0 = Instant::from_millis(1000);
        p.detached(t0);
        assert_eq!(p.poll_timeout(), Some(t0.saturating_add(GRACE)));
        p.handle_timeout(t0.saturating_add(GRACE - Duration::from_millis(1)));
        assert_eq!(p.poll_output(), None);
        p.handle_timeout(t0.saturating_add(GRACE));
        assert_eq!(p.poll_output(), Some(ParkOutput::Expired));
        assert_eq!(p.state(), ParkState::Over);
        assert_eq!(
            p.adopt(t0.saturating_add(GRACE), 0),
            Err(AdoptRefusal::Over)
        );
    }

    /// R-PARK-1: the grace is the bound, not the driver's timer. An
    /// adoption that arrives at the grace's end, before the timer fired,
    /// is refused and the run expires then; one just before it is taken.
    #[test]
    fn r_park_1_an_adoption_after_the_grace_is_refused_even_before_the_timer_fires() {
        let t0 = Instant::from_millis(1000);
        let end = t0.saturating_add(GRACE);
        let mut p = park();
        p.produced("a", 1, false);
        p.detached(t0);
        assert_eq!(p.adopt(end, 0), Err(AdoptRefusal::Over));
        assert_eq!(p.poll_output(), Some(ParkOutput::Expired));
        assert_eq!(p.state(), ParkState::Over);
        let mut p = park();
        p.produced("a", 1, false);
        p.detached(t0);
        let just_before = Instant::from_micros(end.as_micros() - 1);
        assert_eq!(p.adopt(just_before, 0), Ok(vec![(1, "a")]));
        assert_eq!(p.poll_output(), None);
    }

    #[test]
    fn r_park_2_adoption_replays_after_the_journals_last_frame_and_attaches_once() {
        let mut p = park();
        for f in ["a", "b", "c"] {
            p.produced(f, 1, false);
        }
        p.acked(1);
        assert_eq!(
            p.adopt(Instant::ZERO, 1),
            Err(AdoptRefusal::Attached),
            "still attached"
        );
        p.detached(Instant::ZERO);
        // The journal holds through frame 2 (its ack was lost).
        assert_eq!(p.adopt(Instant::ZERO, 2), Ok(vec![(3, "c")]));
        assert_eq!(p.state(), ParkState::Attached);
        assert_eq!(
            p.adopt(Instant::ZERO, 2),
            Err(AdoptRefusal::Attached),
            "one connection at a time"
        );
        assert_eq!(p.poll_timeout(), None, "no grace while attached");
    }

    #[test]
    fn r_park_2_an_adoption_asking_for_dropped_or_unproduced_frames_is_refused() {
        let mut p = park();
        for f in ["a", "b", "c"] {
            p.produced(f, 1, false);
        }
        p.acked(2);
        p.detached(Instant::ZERO);
        assert_eq!(
            p.adopt(Instant::ZERO, 0),
            Err(AdoptRefusal::Gap {
                resume_after: 0,
                first_kept: 3
            })
        );
        assert_eq!(
            p.adopt(Instant::ZERO, 4),
            Err(AdoptRefusal::Ahead {
                resume_after: 4,
                last: 3
            })
        );
        assert_eq!(
            p.state(),
            ParkState::Parked {
                until: Instant::ZERO.saturating_add(GRACE)
            }
        );
        assert_eq!(p.adopt(Instant::ZERO, 2), Ok(vec![(3, "c")]));
    }

    #[test]
    fn the_run_is_done_when_its_terminal_is_acked_even_through_an_adoption() {
        let mut p = park();
        p.produced("a", 1, false);
        p.produced("end", 1, true);
        assert!(!p.wants_provider(), "nothing is read after the terminal");
        p.detached(Instant::ZERO);
        assert!(p.summary().ended);
        // The journal already had the terminal frame.
        assert_eq!(p.adopt(Instant::ZERO, 2), Ok(Vec::new()));
        assert_eq!(p.poll_output(), Some(ParkOutput::Done));
        assert_eq!(p.state(), ParkState::Over);
    }

    #[test]
    fn park_grace_zero_is_the_default_and_is_bounded() {
        assert_eq!(effective_park_grace(0), DEFAULT_PARK_GRACE);
        assert_eq!(effective_park_grace(5), Duration::from_millis(5));
        assert_eq!(effective_park_grace(u64::MAX), MAX_PARK_GRACE);
    }

    #[test]
    fn the_default_buffer_is_the_documented_8_mib() {
        // docs/operations.md, `[node] park_buffer_bytes`.
        assert_eq!(DEFAULT_MAX_KEPT_BYTES, 8 << 20);
    }

    #[test]
    fn r_park_1_an_ack_frees_exactly_the_bytes_of_the_frames_it_drops() {
        let mut p = park();
        p.produced("a", 2, false);
        p.produced("b", 100, false);
        assert!(!p.wants_provider());
        p.acked(1);
        assert!(!p.wants_provider(), "100 bytes still kept, the bound");
        p.acked(2);
        assert!(p.wants_provider());
    }

    #[test]
    fn r_park_2_an_adoption_whose_journal_holds_every_frame_replays_nothing() {
        let mut p = park();
        for f in ["a", "b", "c"] {
            p.produced(f, 1, false);
        }
        p.detached(Instant::ZERO);
        assert_eq!(p.adopt(Instant::ZERO, 3), Ok(Vec::new()));
        assert_eq!(p.state(), ParkState::Attached);
        assert_eq!(p.summary().first_kept, 4, "all three count as acked");
    }

    #[test]
    fn a_cancelled_run_is_over_keeps_nothing_and_cannot_be_adopted() {
        let mut p = park();
        p.produced("a", 1, false);
        p.detached(Instant::ZERO);
        p.cancelled();
        assert_eq!(p.state(), ParkState::Over);
        assert_eq!(p.poll_timeout(), None);
        assert!(!p.wants_provider());
        assert_eq!(p.adopt(Instant::ZERO, 0), Err(AdoptRefusal::Over));
    }

    /// R-PARK-1: the grace runs from the loss of the connection. An
    /// adoption the new connection then refuses returns the run to that
    /// grace; however many are refused, the run expires when it would have.
    #[test]
    fn a_refused_adoption_does_not_extend_the_grace_r_park_1() {
        let mut p = park();
        for f in ["a", "b"] {
            p.produced(f, 1, false);
        }
        let t0 = Instant::from_millis(1_000);
        let until = t0.saturating_add(GRACE);
        p.detached(t0);
        for i in 1..=5u64 {
            let now = t0.saturating_add(Duration::from_secs(5 * i));
            assert_eq!(p.adopt(now, 1), Ok(vec![(2, "b")]));
            assert_eq!(p.state(), ParkState::Attached);
            p.adoption_aborted(now);
            assert_eq!(p.state(), ParkState::Parked { until }, "attempt {i}");
            assert_eq!(p.poll_timeout(), Some(until));
        }
        p.handle_timeout(until);
        assert_eq!(p.poll_output(), Some(ParkOutput::Expired));
        assert_eq!(p.adopt(until, 1), Err(AdoptRefusal::Over));
    }

    /// R-PARK-1: once the adoption took (a frame went on the new
    /// connection), losing that connection is a new loss with its own grace.
    #[test]
    fn an_adoption_that_took_parks_afresh_when_its_connection_is_lost_r_park_1() {
        let mut p = park();
        p.produced("a", 1, false);
        p.detached(Instant::ZERO);
        assert_eq!(p.adopt(Instant::ZERO, 0), Ok(vec![(1, "a")]));
        p.produced("b", 1, false);
        let now = Instant::from_millis(20_000);
        p.adoption_aborted(now);
        assert_eq!(
            p.state(),
            ParkState::Parked {
                until: now.saturating_add(GRACE)
            }
        );
    }

    /// R-PARK-1, R-LIM-4: every frame counts its variable payload plus a
    /// fixed overhead against the bound; no frame type is free.
    #[test]
    fn a_frame_counts_its_payload_plus_the_overhead_against_the_bound_r_park_1() {
        use iop_wire::{Embedding, FinishReason, TokenLogprob, ToolCallDelta, Usage};
        let o = FRAME_OVERHEAD_BYTES;
        assert_eq!(frame_bytes(&RunEventKind::TextDelta("tok1".into())), 4 + o);
        assert_eq!(
            frame_bytes(&RunEventKind::ReasoningDelta("hm".into())),
            2 + o
        );
        let call = ToolCallDelta {
            index: 0,
            id: Some("c1".into()),
            name: Some("get".into()),
            arguments_delta: "{\"a\"".into(),
        };
        assert_eq!(
            frame_bytes(&RunEventKind::ToolCallDelta(call)),
            2 + 3 + 4 + o
        );
        let embedding = Embedding {
            index: 0,
            values: vec![0.5; 10],
        };
        assert_eq!(frame_bytes(&RunEventKind::Embedding(embedding)), 40 + o);
        let logprobs = vec![TokenLogprob {
            token: "abc".into(),
            logprob: -0.1,
            top: vec![("abd".into(), -2.0), ("x".into(), -3.0)],
        }];
        assert_eq!(
            frame_bytes(&RunEventKind::Logprobs(logprobs)),
            (3 + 4) + (3 + 4) + (1 + 4) + o
        );
        assert_eq!(frame_bytes(&RunEventKind::Usage(Usage::default())), o);
        let done = RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: None,
        };
        assert_eq!(frame_bytes(&done), o);
        // At the bound: 100 bytes hold one 36-byte text frame (100), not two.
        let mut p: RunPark<RunEventKind> = RunPark::new(GRACE, 100);
        let frame = RunEventKind::TextDelta("x".repeat(36));
        p.produced(frame.clone(), frame_bytes(&frame), false);
        assert!(!p.wants_provider());
    }

    /// R-DISC-1: a lost connection or a clean end parks a durable run;
    /// only the Edge's reset or stop, or a stream it broke, cancels it.
    #[test]
    fn only_a_reset_stop_or_broken_stream_cancels_a_durable_run_r_disc_1() {
        assert_eq!(EdgeSignal::Finished.verdict(), EdgeVerdict::Park);
        assert_eq!(EdgeSignal::ConnectionLost.verdict(), EdgeVerdict::Park);
        assert_eq!(EdgeSignal::Reset.verdict(), EdgeVerdict::Cancel);
        assert_eq!(EdgeSignal::Stopped.verdict(), EdgeVerdict::Cancel);
        assert_eq!(EdgeSignal::Broken.verdict(), EdgeVerdict::Cancel);
    }

    /// R-PARK-2 (SPEC §3): an adoption's stall timeout follows a fresh
    /// run's rule; one a fresh run is refused for refuses the adoption.
    #[test]
    fn an_adoption_with_a_stall_timeout_a_fresh_run_refuses_is_refused_r_park_2() {
        use iop_wire::{
            DEFAULT_RESPONSE_STALL_TIMEOUT_MS, MAX_RESPONSE_STALL_TIMEOUT_MS,
            MIN_RESPONSE_STALL_TIMEOUT_MS,
        };
        for ms in [
            0,
            1,
            MIN_RESPONSE_STALL_TIMEOUT_MS - 1,
            MIN_RESPONSE_STALL_TIMEOUT_MS,
            MAX_RESPONSE_STALL_TIMEOUT_MS,
            MAX_RESPONSE_STALL_TIMEOUT_MS + 1,
            u64::MAX,
        ] {
            match effective_stall_timeout(ms) {
                Ok(d) => assert_eq!(adoption_stall_timeout(ms), Ok(d)),
                Err(_) => assert_eq!(
                    adoption_stall_timeout(ms),
                    Err(AdoptRefusal::InvalidStallTimeout {
                        stall_timeout_ms: ms
                    })
                ),
            }
        }
        assert_eq!(
            adoption_stall_timeout(0),
            Ok(Duration::from_millis(DEFAULT_RESPONSE_STALL_TIMEOUT_MS))
        );
        assert!(adoption_stall_timeout(MAX_RESPONSE_STALL_TIMEOUT_MS + 1).is_err());
    }

    fn report(generation: u64, run_id: u64, response_id: &str, target: &str) -> ParkedRun {
        ParkedRun {
            key: iop_wire::RunKey { generation, run_id },
            response_id: response_id.into(),
            adapter: AdapterKind::Mock,
            target: target.into(),
            first_kept_frame: 1,
            last_frame: 0,
            ended: false,
        }
    }

    const PARKED: ParkState = ParkState::Parked {
        until: Instant::ZERO,
    };

    /// R-PARK-2: a registration names every run not over, a live report
    /// only the parked ones; both in key then response order.
    #[test]
    fn a_registration_reports_every_run_not_over_a_live_report_the_parked_r_park_2() {
        let runs = [
            (ParkState::Over, report(1, 1, "over", "m")),
            (PARKED, report(2, 1, "b", "m")),
            (ParkState::Attached, report(1, 2, "attached", "m")),
            (PARKED, report(2, 1, "a", "m")),
        ];
        let ids = |scope| -> Vec<String> {
            select_reports(scope, runs.iter().map(|(s, r)| (*s, r)))
                .into_iter()
                .map(|r| r.response_id)
                .collect()
        };
        assert_eq!(ids(ReportScope::Registration), ["attached", "a", "b"]);
        assert_eq!(ids(ReportScope::Live), ["a", "b"]);
    }

    /// R-PARK-2: past the wire bound a report keeps the first runs in key
    /// then response order, the same ones whatever order they come in.
    #[test]
    fn a_report_past_the_wire_bound_keeps_the_first_runs_deterministically_r_park_2() {
        let max = iop_wire::MAX_PARKED_RUNS as u64;
        let mut runs: Vec<(ParkState, ParkedRun)> = (0..max)
            .rev()
            .map(|i| (PARKED, report(1, 10 + i, "r", "m")))
            .collect();
        // Two Edges' runs share key (1, 0), told apart by response.
        runs.push((PARKED, report(1, 0, "z", "m")));
        runs.push((PARKED, report(1, 0, "y", "m")));
        let picked = select_reports(ReportScope::Live, runs.iter().map(|(s, r)| (*s, r)));
        assert_eq!(picked.len(), iop_wire::MAX_PARKED_RUNS);
        assert_eq!(picked[0].response_id, "y");
        assert_eq!(picked[1].response_id, "z");
        assert_eq!(picked.last().map(|r| r.key.run_id), Some(10 + max - 3));
        runs.reverse();
        let again = select_reports(ReportScope::Live, runs.iter().map(|(s, r)| (*s, r)));
        assert_eq!(again, picked);
    }

    /// R-PARK-1: only parked runs hold capacity outside the connections'
    /// count; attached ones are counted by their connection.
    #[test]
    fn only_parked_runs_hold_capacity_outside_the_connections_r_park_1() {
        let runs = [
            (PARKED, report(1, 1, "a", "m")),
            (PARKED, report(1, 2, "b", "other")),
            (ParkState::Attached, report(1, 3, "c", "m")),
            (ParkState::Over, report(1, 4, "d", "m")),
        ];
        assert_eq!(
            parked_capacity(AdapterKind::Mock, "m", runs.iter().map(|(s, r)| (*s, r))),
            ParkedRuns {
                total: 2,
                on_target: 1
            }
        );
        assert_eq!(
            parked_capacity(AdapterKind::Mock, "none", std::iter::empty()),
            ParkedRuns::default()
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Produce(usize, bool),
        Ack(u64),
        Detach,
        Adopt(u64),
        /// An adoption the new connection refuses.
        AdoptRefused(u64),
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1usize..40, prop::bool::weighted(0.05)).prop_map(|(b, t)| Op::Produce(b, t)),
            2 => (0u64..40).prop_map(Op::Ack),
            1 => Just(Op::Detach),
            2 => (0u64..40).prop_map(Op::Adopt),
            1 => (0u64..40).prop_map(Op::AdoptRefused),
            1 => (0u64..60_000).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Against a model that keeps every frame: whatever the sequence,
        /// an accepted adoption replays exactly the frames after its resume
        /// point that the model has, nothing is dropped before its ack,
        /// the kept bytes never pass the bound by more than one frame, and
        /// a run is attached to at most one connection, and a parked run's
        /// grace ends at most the grace after the last loss of a connection
        /// that took it (refused adoptions do not extend it).
        #[test]
        fn frames_are_never_lost_before_their_ack(ops in proptest::collection::vec(op(), 0..80)) {
            let mut p: RunPark<u64> = RunPark::new(GRACE, 100);
            let mut all: Vec<u64> = Vec::new();
            let mut acked = 0u64;
            let mut now = Instant::ZERO;
            let mut attached = true;
            // The grace end the last real loss set.
            let mut lost_until: Option<Instant> = None;
            for op in ops {
                match op {
                    Op::Produce(bytes, terminal) => {
                        if p.wants_provider() {
                            let n = p.produced(all.len() as u64 + 1, bytes, terminal);
                            all.push(n);
                            prop_assert_eq!(n, all.len() as u64);
                        }
                    }
                    Op::Ack(k) => {
                        // An Edge acks only what it was sent (attached).
                        if attached {
                            p.acked(k);
                            acked = acked.max(k.min(all.len() as u64));
                        }
                    }
                    Op::Detach => {
                        if attached {
                            lost_until = Some(now.saturating_add(GRACE));
                        }
                        p.detached(now);
                        attached = false;
                    }
                    Op::AdoptRefused(k) => {
                        let before = p.state();
                        if p.adopt(now, k).is_ok() {
                            if p.state() == ParkState::Attached {
                                p.adoption_aborted(now);
                                prop_assert_eq!(p.state(), before, "back where it was");
                            }
                            acked = acked.max(k);
                        }
                    }
                    Op::Adopt(k) => match p.adopt(now, k) {
                        Ok(replay) => {
                            prop_assert!(!attached, "adopted while attached");
                            prop_assert!(k >= acked || k + 1 >= p.summary().first_kept);
                            let expected: Vec<u64> = all.iter().copied().filter(|n| *n > k).collect();
                            if p.state() == ParkState::Attached {
                                let got: Vec<u64> = replay.iter().map(|(n, f)| { assert_eq!(n, f); *n }).collect();
                                prop_assert_eq!(got, expected);
                            }
                            acked = acked.max(k);
                            attached = p.state() == ParkState::Attached;
                        }
                        Err(AdoptRefusal::Attached) => prop_assert!(attached),
                        Err(AdoptRefusal::Gap { first_kept, .. }) => prop_assert!(k + 1 < first_kept && first_kept > acked.min(first_kept)),
                        Err(AdoptRefusal::Ahead { last, .. }) => prop_assert!(k > last),
                        Err(AdoptRefusal::Over) => prop_assert_eq!(p.state(), ParkState::Over),
                        Err(AdoptRefusal::InvalidStallTimeout { .. }) => prop_assert!(false, "not decided here"),
                    },
                    Op::Tick(ms) => {
                        now = now.saturating_add(Duration::from_millis(ms));
                        p.handle_timeout(now);
                    }
                }
                if let (ParkState::Parked { until }, Some(bound)) = (p.state(), lost_until) {
                    prop_assert!(until <= bound, "grace extended");
                }
                if p.state() != ParkState::Over {
                    // Nothing after the last ack is gone.
                    prop_assert!(p.summary().first_kept <= acked + 1);
                    prop_assert!(p.kept_bytes < 100 + 40);
                }
                while let Some(out) = p.poll_output() {
                    prop_assert!(matches!(out, ParkOutput::Expired | ParkOutput::Done));
                    attached = false;
                }
            }
        }
    }
}
