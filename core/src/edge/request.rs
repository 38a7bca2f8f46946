//! One client request, as a sans-IO session machine.
//!
//! A [`Request`] owns everything one Chat Completions / Responses / Ollama
//! request decides between the HTTP handler and the node stream: its
//! [`StreamGate`] (commit, attempts, the shared budget, R-GATE-1..4), the
//! attempt and lease it holds, the R-SEL-1 hints of a re-admission, the
//! pre-commit hold buffer and its bounds, the mapping of an admission
//! refusal, the tunnel-or-run choice, the classification of a failure to
//! open the node stream, and what a fence means in each phase (R-GEN-3,
//! R-GEN-4). The Edge's request driver and the simulator drive the same
//! machine; neither decides anything about a request.
//!
//! ## Traffic
//!
//! * With the [`Dispatcher`](crate::edge::dispatch::Dispatcher): the
//!   request emits [`RequestOutput::Dispatch`] carrying a
//!   [`RequestCommand`]; the driver feeds it to the dispatcher as
//!   [`DispatchInput::Request`](crate::edge::dispatch::DispatchInput::Request)
//!   and carries every
//!   [`DispatchOutput::ToRequest`](crate::edge::dispatch::DispatchOutput::ToRequest)
//!   back as [`RequestInput::Dispatch`].
//! * With the node: [`RequestOutput::Open`] asks the driver to open the
//!   node stream and send the request (answered by [`RequestInput::Opened`]
//!   or [`RequestInput::OpenFailed`]); every frame read from it is a
//!   [`RequestInput::Frame`]; a stream that ends without a terminal is
//!   [`RequestInput::StreamEnded`]. [`RequestOutput::CloseAttempt`] resets
//!   it.
//! * With the client: [`RequestOutput::Deliver`] in order; a client that
//!   went away is [`RequestInput::ClientDisconnected`].
//! * With the tenant's limits (R-TEN-2): before each further attempt that
//!   sends the prompt again (a failover, a continuation) the request asks
//!   for a fresh reservation with [`RequestOutput::ReserveAttempt`]; the
//!   driver answers [`RequestInput::AttemptReserved`] or
//!   [`RequestInput::AttemptRefused`] (from
//!   [`Tenants::reserve_attempt`](crate::tenant::Tenants::reserve_attempt)),
//!   and a refused request ends with the tenant's 429 and calls no
//!   provider. The first attempt's reservation is the admission's; an
//!   adoption sends nothing again and asks nothing (a taken-over request's
//!   adoption is reserved when its hold is taken,
//!   [`Tenants::admit_adopted`](crate::tenant::Tenants::admit_adopted)).
//!   What the request settles with is the usage its answer reports plus
//!   [`Request::unmetered`]: the estimated input and output of the
//!   attempts that ended without a usage report.
//!
//! ## Driver loop
//!
//! As every machine of this crate: feed an input or fire
//! [`Request::handle_timeout`], drain [`Request::poll_output`] until `None`,
//! sleep until [`Request::poll_timeout`]. [`Request::is_ended`] says when
//! the driver may stop: every output has then been queued, the last of them
//! a [`RequestCommand::Cancel`] that lets go of whatever the request still
//! held.

use std::collections::VecDeque;

use iop_wire::{ExecutionFailure, FailureCode, ProviderTunnelFrame, RunEventKind, RunKey, Usage};

use crate::edge::admission::{AdmitRejection, DispatchRequest, Lease, LeaseId, PreSend, RequestId};
pub use crate::edge::delivery::{Delivery, ProviderFault, ProviderSaid};
use crate::edge::dispatch::{KeptRuns, ParkedOffer, RequestCommand, RequestEvent};
use crate::edge::durable::{
    AfterRefusal, FrameSource, JournalAck, JournalSpec, JournalWrite, MAX_UNPUBLISHED, Publisher,
    ResumedAnswer,
};
use crate::edge::gate::{
    AdmissionFailure, AttemptEvent, AttemptFrame, AttemptId, GateBudget, GateEvent, GateFailure,
    GateInput, GateOutput, StreamGate, failure_may_fail_over,
};
pub use crate::edge::tunnel_meter::TunnelApi;
use crate::edge::tunnel_meter::TunnelMeter;
use crate::ids::{Generation, NodeId, ProviderId};
use crate::journal::{JournalError, RecordStatus, Terminal};
#[cfg(feature = "planted-bugs")]
use crate::planted::{Planted, PlantedBug};
use crate::tenant::{AttemptRefusal, Unmetered};
use crate::time::Instant;

/// The most deliveries held before commit (R-GATE-2 holds everything that
/// is not content). An attempt whose node keeps sending non-content frames
/// past this fails instead of growing the buffer (R-LIM-3).
pub const MAX_HELD_DELIVERIES: usize = 256;

/// The most bytes held before commit, counted as decoded (text, tool-call
/// fields, body bytes, header names and values); see
/// [`MAX_HELD_DELIVERIES`].
pub const MAX_HELD_BYTES: usize = 1024 * 1024;

/// Bytes counted per held delivery on top of its payload (the enum and
/// queue slot), so that many empty items also reach the bound.
const HELD_ITEM_OVERHEAD: usize = 64;

/// What a [`Request`] is created with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RequestSpec {
    /// The request's id, unique per Edge process.
    pub request_id: RequestId,
    /// Candidate providers, in preference order.
    pub pool: Vec<ProviderId>,
    /// Attempts and total time (R-GATE-2).
    pub budget: GateBudget,
    /// The API of the raw client request, when it can be relayed as a
    /// tunnel (`None`: normalized runs only).
    pub tunnel_api: Option<TunnelApi>,
    /// The providers of the pool configured in tunnel mode.
    pub tunnel_providers: Vec<ProviderId>,
    /// The record a durable response writes (R-JRN-1): every delivery is
    /// journaled before it reaches the client, and the client going away
    /// does not end the request. `None`: an ephemeral stream.
    #[serde(default)]
    pub journal: Option<JournalSpec>,
    /// How long a durable run may stay on its node without a connection
    /// (R-PARK-1); `0`: the request does not wait for an adoption, a lost
    /// connection after commit ends it.
    #[serde(default)]
    pub park_grace_ms: u64,
    /// R-CONT-1 (opt-in per route): after commit, an attempt that failed
    /// for good continues on another provider of the pool from what the
    /// client already has.
    #[serde(default)]
    pub continuation: bool,
    /// The prompt's tokens as the request's reservation estimated them
    /// (from above, [`crate::tenant::prompt_tokens_max`] of what it sends):
    /// what each attempt a provider accepted and that ended without a
    /// usage report is charged as input (R-TEN-2). 0: nothing to charge.
    #[serde(default)]
    pub prompt_tokens: u64,
}

/// How long a further attempt whose reservation waits for a claim on its
/// way asks again (R-TEN-2, R-TEN-3).
pub const RESERVE_RETRY: std::time::Duration = std::time::Duration::from_millis(50);

/// The most times one further attempt asks for its reservation (20 x
/// [`RESERVE_RETRY`]: a second for the store to answer the claim).
pub const MAX_RESERVE_ASKS: u32 = 20;

/// How long a terminal the store refused waits before it is written again.
pub const JOURNAL_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// How much longer than the park grace a durable request waits for its
/// parked run to be reported (the node must reconnect and register).
pub const PARK_REPORT_SLACK: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether a request may continue its answer on another provider after
/// commit (R-CONT-1): its route opted in, and it is a chat run, the one
/// API whose conversation can carry the answer so far as the assistant's
/// final, partial message.
pub fn continuation_allowed(api: iop_wire::RunApi, route_opted_in: bool) -> bool {
    route_opted_in && api == iop_wire::RunApi::Chat
}

/// The conversation an attempt sends (R-CONT-1): the request's own, and
/// for an attempt that continues an answer, that answer so far as the
/// assistant's final message (the node asks the provider to continue it).
pub fn continued_messages(
    messages: &[iop_wire::ChatMessage],
    continuation: Option<&str>,
) -> Vec<iop_wire::ChatMessage> {
    let mut messages = messages.to_vec();
    if let Some(prefix) = continuation {
        messages.push(iop_wire::ChatMessage {
            role: iop_wire::Role::Assistant,
            content: prefix.to_owned(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            images: Vec::new(),
            cache_control: None,
            documents: Vec::new(),
        });
    }
    messages
}

/// An attempt that continues a parked run instead of starting one
/// (R-PARK-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdoptSpec {
    /// The parked run.
    pub key: RunKey,
    /// The last of its frames the journal holds.
    pub resume_after_frame: u64,
}

/// Why the node stream of an attempt could not be opened or the request
/// not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpenFailure {
    /// The lease's connection is not there any more.
    NoConnection,
    /// Opening the stream or writing the request failed.
    Transport,
    /// The request cannot be encoded on the wire (too large): the client's
    /// fault, never retried.
    Unencodable,
}

/// One frame read from the attempt's node stream.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeFrame {
    /// A normalized run event.
    Run(RunEventKind),
    /// A tunnel frame.
    Tunnel(ProviderTunnelFrame),
}

/// One input of a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestInput {
    /// What the dispatcher answered or decided about this request.
    Dispatch(RequestEvent),
    /// The node stream of the pending [`RequestOutput::Open`] is open and
    /// the request was sent.
    Opened,
    /// The pending [`RequestOutput::Open`] failed.
    OpenFailed(OpenFailure),
    /// A frame of the current attempt's node stream.
    Frame(NodeFrame),
    /// The current attempt's node stream ended without a terminal frame.
    StreamEnded,
    /// The client went away (R-GATE-4). A durable response ignores it: its
    /// answer outlives the client (SPEC §6); only [`RequestInput::Cancel`]
    /// ends it.
    ClientDisconnected,
    /// The client asked to cancel the response (`POST .../cancel`): the run
    /// is canceled and a durable record ends `cancelled`.
    Cancel,
    /// The store answered the pending [`RequestOutput::Journal`].
    Journaled(JournalAck),
    /// A node reported a parked run (R-PARK-2): if it is this request's,
    /// the request adopts it.
    ParkedRun(ParkedOffer),
    /// A node registered and named every run it keeps (R-PARK-2): a run of
    /// this request lost on that node's earlier generation and not named
    /// is gone, and the request stops waiting for it at once.
    KeptRuns(std::sync::Arc<KeptRuns>),
    /// The pending [`RequestOutput::ReserveAttempt`] was reserved: the
    /// attempt is admitted.
    AttemptReserved,
    /// The tenant's limits refused the pending
    /// [`RequestOutput::ReserveAttempt`] (R-TEN-2): the request ends with
    /// the refusal's 429, no provider is called again; while a claim that
    /// may let it fit is on its way, it asks again after
    /// [`RESERVE_RETRY`], at most [`MAX_RESERVE_ASKS`] times.
    AttemptRefused(AttemptRefusal),
}

/// An observation for metrics, spans and logs (closed values and
/// configured names only).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestObservation {
    /// A recovery eligibility decision or result (the gate's).
    Gate(GateEvent),
    /// A re-admission was issued.
    Readmitted,
    /// The response was committed (time to first content).
    Committed,
    /// An admission went out: the wait for a lease starts.
    Admitting,
    /// The wait ended with a lease on this provider.
    Leased {
        /// The lease's provider.
        provider_id: ProviderId,
    },
    /// The wait ended without a lease.
    AdmissionFailed(AdmissionFailure),
    /// Attempt `attempt` (from 1) starts on this provider; its `Open`
    /// follows.
    AttemptStarted {
        /// The attempt's provider.
        provider_id: ProviderId,
        /// Its number.
        attempt: u32,
    },
    /// The attempt ended: `None` completed, else why not.
    AttemptEnded {
        /// Its failure, if any.
        failure: Option<FailureCode>,
    },
    /// The request ended after this many attempts.
    Ended {
        /// Attempts dispatched.
        attempts: u32,
    },
    /// Its committed run lost its connection and is waited for on its node
    /// (R-PARK-1).
    Parked,
    /// Its parked run was adopted on a new connection (R-PARK-2).
    Adopted,
    /// Its run's node registered again without the run (R-PARK-2): the
    /// run is gone, and its wait ended before the grace did.
    RunNotKept,
    /// A journal write was fenced: another Edge raised the record's epoch
    /// and writes it now (R-JRN-3, R-TAKE-1). The request stops and tells
    /// no client anything: what its clients see is the record's, and the
    /// record goes on under that Edge, which gives it its one terminal
    /// (R-JRN-1, R-JRN-4). A reader following the record reads on.
    RecordTaken,
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestOutput {
    /// Feed this to the dispatcher.
    Dispatch(RequestCommand),
    /// Open a node stream on the lease's connection and send the request:
    /// a tunnel of the raw request when `tunnel`, else a normalized run,
    /// with `deadline_ms` as its hard deadline (R-WD-7). Answer with
    /// [`RequestInput::Opened`] or [`RequestInput::OpenFailed`].
    Open {
        /// The lease that passed the pre-send fence (R-GEN-4).
        lease: Lease,
        /// Relay the raw request instead of a normalized run.
        tunnel: bool,
        /// What is left of the request's budget, in ms (at least 1).
        deadline_ms: u64,
        /// Continue this parked run instead of starting one (R-PARK-2).
        adopt: Option<AdoptSpec>,
        /// R-CONT-1: the answer so far; the provider continues it (it is
        /// the conversation's final, partial assistant message).
        continuation: Option<String>,
    },
    /// Tell the node every frame of the run through `through_frame` is
    /// durable (R-PARK-1): it drops them.
    AckFrames {
        /// The last durable frame.
        through_frame: u64,
    },
    /// Reset the current attempt's node stream (the node cancels the run).
    CloseAttempt,
    /// Send this to the client.
    Deliver(Delivery),
    /// Write this to the response's journal and answer with
    /// [`RequestInput::Journaled`]; one write is in flight at a time.
    Journal(JournalWrite),
    /// Reserve the tenant's tokens and budget for attempt `attempt` (2 and
    /// on), which sends the prompt again (R-TEN-2), and
    /// `extra_input_tokens_max` more input tokens (a continuation's answer
    /// so far, bounded from above by its bytes). Answer with
    /// [`RequestInput::AttemptReserved`] or [`RequestInput::AttemptRefused`]
    /// (a request not held to a tenant's limits is reserved at once).
    ReserveAttempt {
        /// The attempt's number.
        attempt: u32,
        /// Input it sends besides the prompt.
        extra_input_tokens_max: u64,
    },
    /// Count or log this.
    Observe(RequestObservation),
}

/// Where a request is, as an operator sees it (the console, `/status`):
/// a closed name for each step of [`Request`]'s life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestPhase {
    /// Its admission is out, or it waits in the queue for capacity.
    Queued,
    /// A lease was granted; the attempt's node stream is being opened.
    Sending,
    /// The attempt runs on its provider.
    Running,
    /// Its committed run lost its connection and waits on its node
    /// (R-PARK-1), or is being adopted (R-PARK-2).
    Parked,
    /// The attempt ended; the dispatcher's verdict on it is awaited.
    Settling,
    /// Over.
    Ended,
}

impl RequestPhase {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestPhase::Queued => "queued",
            RequestPhase::Sending => "sending",
            RequestPhase::Running => "running",
            RequestPhase::Parked => "parked",
            RequestPhase::Settling => "settling",
            RequestPhase::Ended => "ended",
        }
    }
}

/// Where the request is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// A further attempt's reservation is out (R-TEN-2); its answer is
    /// awaited before the admission.
    Reserving,
    /// An admission command is out; its answer is awaited.
    Admitting,
    /// Waiting in the dispatcher's queue (or being re-resolved after a
    /// stale pre-send fence).
    Queued,
    /// A lease was granted; its pre-send fence is out.
    PreSending(LeaseId),
    /// The attempt was dispatched; its node stream is being opened.
    Opening { lease: Lease, attempt: AttemptId },
    /// The attempt's node stream is open.
    Running {
        lease: Lease,
        attempt: AttemptId,
        tunnel: bool,
        head_seen: bool,
        /// The run's identity for life (R-PARK-2).
        key: RunKey,
        /// The last frame received from it.
        frames: u64,
    },
    /// The committed run lost its connection; its node keeps it (R-PARK-1)
    /// until `until`, when the attempt counts as lost.
    Parked {
        attempt: AttemptId,
        key: RunKey,
        resume_after: u64,
        until: Instant,
    },
    /// The adoption command is out (R-PARK-2).
    Adopting,
    /// The attempt's terminal went to the dispatcher; its verdict is
    /// awaited (R-LEASE-1).
    AwaitingVerdict {
        lease_id: LeaseId,
        attempt: AttemptId,
        code: Option<FailureCode>,
        /// The failure may go to another provider (R-FAIL-1).
        may_fail_over: bool,
        /// The node marked the terminal `retryable`: its provider call
        /// ended (R-WD-4). A stall without it is never re-admitted
        /// (R-FAIL-1).
        retryable: bool,
    },
    /// Over; nothing more is output.
    Ended,
}

/// One client request's session (see the [module docs](self)).
#[derive(Debug)]
pub struct Request {
    spec: RequestSpec,
    gate: StreamGate,
    phase: Phase,
    avoid_provider_id: Option<ProviderId>,
    allow_avoided_fallback: bool,
    held: VecDeque<Delivery>,
    held_bytes: usize,
    head_delivered: bool,
    /// A journal refusal's error terminal went to the client.
    journal_failure_delivered: bool,
    /// An attempt was started and its end not yet observed.
    attempt_open: bool,
    outputs: VecDeque<RequestOutput>,
    /// Publish after durable, for a durable response (R-JRN-1).
    publisher: Option<Publisher>,
    /// The adoption in progress: the attempt it continues, the run and its
    /// resume point (R-PARK-2).
    adopting: Option<(AttemptId, AdoptSpec)>,
    /// The node frame being processed, for the journal events it makes.
    source: Option<FrameSource>,
    /// (journal event that must be durable, frame): a frame is acked once
    /// its mark's event is durable; `u64::MAX` waits for the terminal.
    marks: VecDeque<(u64, u64)>,
    /// When a terminal the store refused is written again.
    journal_retry_at: Option<Instant>,
    /// The answer's text the client has (R-CONT-1).
    delivered_text: String,
    /// The next attempt continues the answer (R-CONT-1).
    continuing: bool,
    /// Usage reported by attempts before the current one (R-CONT-1: the
    /// answer's usage is the sum of its attempts').
    usage_carry: Option<Usage>,
    /// Usage the current attempt reported so far.
    attempt_usage: Option<Usage>,
    /// What the current attempt's tunnelled answer used, read from the
    /// bytes relayed (R-TEN-2): set by its success head.
    tunnel_meter: Option<TunnelMeter>,
    /// Characters of reasoning and tool calls the current attempt
    /// delivered (R-TEN-2: estimated with its text when unreported).
    attempt_other_chars: u64,
    /// Where the current attempt's text begins in `delivered_text`.
    attempt_text_from: usize,
    /// Estimated output tokens of the attempts before the current one
    /// that ended without a usage report (R-TEN-2).
    unmetered_output_tokens: u64,
    /// The current attempt's provider accepted it (its `Started`, a
    /// tunnel's success head, its first content or usage): it read the
    /// prompt (R-TEN-2).
    attempt_accepted: bool,
    /// What the current attempt sent as input, estimated from above: the
    /// prompt, and a continuation's answer so far (R-TEN-2).
    attempt_input_tokens: u64,
    /// Estimated input tokens of the attempts before the current one that
    /// a provider accepted and that ended without a usage report
    /// (R-TEN-2).
    unmetered_input_tokens: u64,
    /// A journal write was fenced: another Edge took the record over and
    /// charges the answer the journal holds (R-TEN-2, R-TAKE-1).
    record_taken: bool,
    /// The store refused a journal write and what was not yet published
    /// was dropped: a usage report among it reached no client, yet its
    /// provider counted it (R-TEN-2, R-JRN-6).
    usage_unpublished: bool,
    /// The provider of the parked run: only its node's report is this
    /// request's run (R-PARK-2).
    parked_provider: Option<ProviderId>,
    /// The node of the parked run, and the generation it was lost on
    /// (`None`: an adoption's offer, whose own report names it): a later
    /// registration of that node that does not name it says it is gone.
    parked_on: Option<(NodeId, Option<Generation>)>,
    /// The attempt whose run its node no longer keeps, heard before its
    /// stream ended: it is not parked when it does.
    not_kept: Option<AttemptId>,
    /// It continues an answer whose run is gone ([`Self::continuing`]):
    /// its continuation may fall back to the last provider.
    orphan_continuation: bool,
    /// What the provider said when the last attempt ended on its error
    /// (R-GATE-3: the client is told).
    provider_said: Option<ProviderSaid>,
    /// The pending further attempt's reservation: times asked, and when it
    /// asks again (R-TEN-2).
    reserve_asks: u32,
    reserve_again_at: Option<Instant>,
    #[cfg(feature = "planted-bugs")]
    planted: Planted,
}

/// The pre-commit buffer is full.
#[derive(Debug, Clone, Copy)]
struct HeldOverflow;

impl Request {
    /// A request accepted at `now`. Its first admission (zero R-SEL-1
    /// hints) is queued as the first output.
    pub fn new(now: Instant, spec: RequestSpec) -> Self {
        let mut gate = StreamGate::new(now, spec.budget);
        // R-FAIL-1: a failed attempt can go elsewhere only if there is an
        // elsewhere.
        gate.set_failover(spec.pool.len() > 1);
        gate.set_continuation(spec.continuation);
        let publisher = spec
            .journal
            .clone()
            .map(|journal| Publisher::new(journal, 0));
        let mut request = Self {
            spec,
            gate,
            phase: Phase::Admitting,
            avoid_provider_id: None,
            allow_avoided_fallback: false,
            held: VecDeque::new(),
            held_bytes: 0,
            head_delivered: false,
            journal_failure_delivered: false,
            attempt_open: false,
            outputs: VecDeque::new(),
            publisher,
            adopting: None,
            source: None,
            marks: VecDeque::new(),
            journal_retry_at: None,
            delivered_text: String::new(),
            continuing: false,
            usage_carry: None,
            attempt_usage: None,
            tunnel_meter: None,
            attempt_other_chars: 0,
            attempt_text_from: 0,
            unmetered_output_tokens: 0,
            attempt_accepted: false,
            attempt_input_tokens: 0,
            unmetered_input_tokens: 0,
            record_taken: false,
            usage_unpublished: false,
            parked_provider: None,
            parked_on: None,
            not_kept: None,
            orphan_continuation: false,
            provider_said: None,
            reserve_asks: 0,
            reserve_again_at: None,
            #[cfg(feature = "planted-bugs")]
            planted: Planted::default(),
        };
        request.admit();
        request
    }

    /// A request that takes over a record whose run is parked on a node
    /// (R-TAKE-1, R-PARK-2): the record's epoch was raised for it
    /// (`spec.journal`), `last_seq` events are durable and the last of
    /// them came from frame `resume_after_frame` of the run. It adopts the
    /// run at once; it never starts the prompt again: a lost adoption ends
    /// it in the stream, or continues its answer on the pool when the
    /// route opts in and `resumed` holds the answer so far (R-CONT-1).
    pub fn adopting(
        now: Instant,
        spec: RequestSpec,
        offer: &ParkedOffer,
        last_seq: u64,
        resume_after_frame: u64,
        resumed: Option<&ResumedAnswer>,
    ) -> Self {
        let mut request = Self::new(now, spec);
        // Replace the first admission with the adoption: the attempt is the
        // run's, already started and, for the client, committed.
        request.outputs.clear();
        request.publisher = request
            .spec
            .journal
            .clone()
            .map(|journal| Publisher::new(journal, last_seq));
        // A lost adoption is continued on the pool when the route opts in
        // and the journal's answer so far is known (R-CONT-1: continuing
        // without it would send the prompt from scratch); nothing else
        // re-admits a committed answer.
        request
            .gate
            .set_failover(request.spec.continuation && resumed.is_some());
        request.orphan_continuation = true;
        if let Some(resumed) = resumed {
            request.delivered_text = resumed.text.clone();
            // The adopted run's own usage, cumulative: its later reports
            // replace it, a continuation adds to it. The run's text is the
            // answer so far (its usage at the end covers it, R-TEN-2).
            request.attempt_usage = resumed.usage;
        }
        // R-TEN-2: the adopted run is an attempt its provider accepted;
        // lost without a usage report, its prompt is charged.
        request.attempt_accepted = true;
        request.attempt_input_tokens = request.spec.prompt_tokens;
        if let Some(attempt) = request.committed_before(now, offer.provider_id.clone()) {
            request.attempt_open = true;
            request.parked_provider = Some(offer.provider_id.clone());
            request.parked_on = Some((offer.node.clone(), None));
            request.phase = Phase::Parked {
                attempt,
                key: offer.run.key,
                resume_after: resume_after_frame,
                until: now.saturating_add(PARK_REPORT_SLACK),
            };
            request.handle_input(now, RequestInput::ParkedRun(offer.clone()));
        }
        request
    }

    /// A request that takes over a record whose run is gone and continues
    /// its answer (R-TAKE-1, R-CONT-1): the record's epoch was raised for
    /// it (`spec.journal`) and `resumed` is what its journal holds. The
    /// answer so far stands as one committed attempt whose transport was
    /// lost; the gate continues it on the pool, another provider than the
    /// last one first and that one if no other can take it. It never
    /// sends the prompt from scratch: without continuation
    /// (`spec.continuation`), a pool or an attempt left, the answer ends
    /// in the stream.
    pub fn continuing(now: Instant, spec: RequestSpec, resumed: &ResumedAnswer) -> Self {
        let mut request = Self::new(now, spec);
        request.outputs.clear();
        request.publisher = request
            .spec
            .journal
            .clone()
            .map(|journal| Publisher::new(journal, resumed.last_seq));
        request.gate.set_failover(true);
        request.orphan_continuation = true;
        request.delivered_text = resumed.text.clone();
        request.usage_carry = resumed.usage;
        // R-TEN-2: the answer so far is charged by its usage when that
        // reached the journal, else by an estimate of its text (the attempt
        // that wrote it ended without a report).
        if resumed.usage.is_some() {
            request.attempt_text_from = resumed.text.len();
        }
        // The journal names the provider of its last frame; an answer
        // without one counts as the pool's first provider's.
        let provider_id = resumed
            .provider_id
            .clone()
            .or_else(|| request.spec.pool.first().cloned())
            .unwrap_or_else(|| ProviderId::from(""));
        if let Some(attempt) = request.committed_before(now, provider_id) {
            // R-TEN-2: the attempt that wrote the answer so far was
            // accepted by its provider; without a usage journaled, its
            // prompt is charged with the estimate of its text.
            request.attempt_accepted = resumed.usage.is_none();
            request.attempt_input_tokens = request.spec.prompt_tokens;
            request.attempt_event(now, attempt, AttemptEvent::TransportLost);
        }
        request
    }

    /// A taken-over record's answer so far as the gate's first attempt,
    /// on `provider_id`: dispatched and committed, its head already the
    /// journal's (no output). The attempt, if the gate opened one.
    fn committed_before(&mut self, now: Instant, provider_id: ProviderId) -> Option<AttemptId> {
        let _ = self
            .gate
            .handle_input(now, GateInput::Dispatched { provider_id });
        let attempt = self.gate.current_attempt()?;
        let _ = self.gate.handle_input(
            now,
            GateInput::Attempt {
                attempt,
                event: AttemptEvent::Content,
            },
        );
        self.head_delivered = true;
        self.drain_gate(now);
        self.outputs.clear();
        Some(attempt)
    }

    /// Whether the request waits for parked run `key` (R-PARK-2).
    pub fn awaits_parked(&self, key: RunKey) -> bool {
        matches!(self.phase, Phase::Parked { key: k, .. } if k == key)
    }

    /// Switch a planted bug on in this request (test-only; see
    /// [`crate::planted`]).
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&self, bug: PlantedBug) {
        self.planted.plant(bug);
    }

    #[cfg(feature = "planted-bugs")]
    fn planted(&self, bug: PlantedBug) -> bool {
        self.planted.has(bug)
    }

    /// Planted (R-FAIL-1): a confirmed stall re-admits whatever its
    /// `retryable` mark. Always false without the feature.
    fn readmits_any_stall(&self) -> bool {
        #[cfg(feature = "planted-bugs")]
        if self.planted(PlantedBug::ReadmitUnretryableStall) {
            return true;
        }
        false
    }

    /// The request's id.
    pub fn request_id(&self) -> RequestId {
        self.spec.request_id
    }

    /// The request's gate (read access: commit state, attempts, end).
    pub fn gate(&self) -> &StreamGate {
        &self.gate
    }

    /// Where the request is now (for operators; decisions read the
    /// machine's own state).
    pub fn phase(&self) -> RequestPhase {
        match self.phase {
            Phase::Reserving | Phase::Admitting | Phase::Queued => RequestPhase::Queued,
            Phase::PreSending(_) | Phase::Opening { .. } => RequestPhase::Sending,
            Phase::Running { .. } => RequestPhase::Running,
            Phase::Parked { .. } | Phase::Adopting => RequestPhase::Parked,
            Phase::AwaitingVerdict { .. } => RequestPhase::Settling,
            Phase::Ended => RequestPhase::Ended,
        }
    }

    /// The lease of the attempt in flight, if one is being opened or runs.
    pub fn attempt_lease(&self) -> Option<&Lease> {
        match &self.phase {
            Phase::Opening { lease, .. } | Phase::Running { lease, .. } => Some(lease),
            _ => None,
        }
    }

    /// Whether the request is over: nothing more will be output (for a
    /// durable response: and its journal writes are done).
    pub fn is_ended(&self) -> bool {
        self.phase == Phase::Ended && self.publisher.as_ref().is_none_or(Publisher::is_idle)
    }

    /// Whether the driver may read the next node frame: a durable response
    /// whose journal falls behind stops reading (the provider is
    /// back-pressured) until its appends catch up (R-JRN-1, R-LIM-4).
    pub fn wants_frames(&self) -> bool {
        self.publisher
            .as_ref()
            .is_none_or(|p| p.backlog() < MAX_UNPUBLISHED)
    }

    /// The last journal event acknowledged durable (0 for an ephemeral
    /// request).
    pub fn durable_seq(&self) -> u64 {
        self.publisher.as_ref().map_or(0, Publisher::durable_seq)
    }

    /// Whether an attempt's node stream may be open (being opened, running,
    /// or waiting for its terminal's verdict).
    fn has_stream(&self) -> bool {
        matches!(
            self.phase,
            Phase::Opening { .. } | Phase::Running { .. } | Phase::AwaitingVerdict { .. }
        )
    }

    /// Approximate bytes held before commit.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Feed one input at `now`, then drain [`Self::poll_output`].
    pub fn handle_input(&mut self, now: Instant, input: RequestInput) {
        if let RequestInput::Journaled(ack) = input {
            self.on_journaled(now, ack);
            return;
        }
        if self.phase == Phase::Ended {
            return;
        }
        match input {
            RequestInput::Journaled(_) => {}
            RequestInput::AttemptReserved => {
                if self.phase == Phase::Reserving {
                    self.reserve_again_at = None;
                    self.admit();
                }
            }
            RequestInput::AttemptRefused(AttemptRefusal {
                refusal,
                claim_pending,
            }) => {
                if self.phase == Phase::Reserving && self.reserve_again_at.is_none() {
                    if claim_pending && self.reserve_asks < MAX_RESERVE_ASKS {
                        // R-TEN-3: this Edge holds too little yet; the
                        // store's answer to its claim may be enough.
                        self.reserve_again_at = Some(now.saturating_add(RESERVE_RETRY));
                        return;
                    }
                    // R-TEN-2: the attempt is not made; the request ends
                    // with the tenant's error (the gate's terminal).
                    let failure = AdmissionFailure::Tenant {
                        kind: refusal.kind,
                        retry_after_ms: refusal.retry_after_ms,
                    };
                    self.phase = Phase::Admitting;
                    self.observe(RequestObservation::AdmissionFailed(failure));
                    let _ = self
                        .gate
                        .handle_input(now, GateInput::AdmissionFailed(failure));
                    self.drain_gate(now);
                }
            }
            RequestInput::Dispatch(event) => self.on_dispatch(now, event),
            RequestInput::Opened => {
                if let Phase::Opening { lease, attempt } = &self.phase {
                    let (lease, attempt) = (lease.clone(), *attempt);
                    // An adopted run keeps its identity and numbering.
                    let (key, frames) = match self.adopting.take() {
                        Some((_, adopt)) => {
                            self.observe(RequestObservation::Adopted);
                            (adopt.key, adopt.resume_after_frame)
                        }
                        None => (
                            RunKey {
                                generation: lease.generation,
                                run_id: lease.run_id,
                            },
                            0,
                        ),
                    };
                    self.phase = Phase::Running {
                        tunnel: self.tunnel_for(&lease),
                        lease,
                        attempt,
                        head_seen: false,
                        key,
                        frames,
                    };
                }
            }
            RequestInput::OpenFailed(_) if self.adopting.is_some() => {
                if let Phase::Opening { .. } = self.phase {
                    self.repark(now);
                }
            }
            RequestInput::OpenFailed(failure) => {
                if let Phase::Opening { attempt, .. } = self.phase {
                    // The node never got the run or gets a cancel for it;
                    // the attempt ends with its event (R-GATE-1).
                    let event = match failure {
                        OpenFailure::Unencodable => AttemptEvent::Failed {
                            code: FailureCode::InvalidRequest,
                        },
                        OpenFailure::NoConnection | OpenFailure::Transport => {
                            AttemptEvent::TransportLost
                        }
                    };
                    self.abandon_attempt(now, attempt, event);
                }
            }
            RequestInput::Frame(frame) => self.on_frame(now, frame),
            RequestInput::StreamEnded => match self.phase {
                Phase::Running { attempt, .. } => self.lose_stream(now, attempt),
                Phase::Opening { .. } if self.adopting.is_some() => self.repark(now),
                Phase::Opening { attempt, .. } => {
                    self.abandon_attempt(now, attempt, AttemptEvent::TransportLost);
                }
                _ => {}
            },
            RequestInput::ParkedRun(offer) => {
                if let Phase::Parked {
                    attempt,
                    key,
                    resume_after,
                    ..
                } = self.phase
                    && key == offer.run.key
                    && self.parked_provider.as_ref() == Some(&offer.provider_id)
                {
                    // R-PARK-2: its held capacity becomes this request's
                    // lease on the node's new connection.
                    self.adopting = Some((
                        attempt,
                        AdoptSpec {
                            key,
                            resume_after_frame: resume_after,
                        },
                    ));
                    self.phase = Phase::Adopting;
                    self.outputs
                        .push_back(RequestOutput::Dispatch(RequestCommand::Adopt {
                            node: offer.node.clone(),
                            request_id: self.spec.request_id,
                            key,
                        }));
                }
            }
            RequestInput::KeptRuns(kept) => self.on_kept_runs(now, &kept),
            RequestInput::ClientDisconnected => {
                if self.publisher.is_none() {
                    let _ = self.gate.handle_input(now, GateInput::ClientDisconnected);
                    self.drain_gate(now);
                }
            }
            RequestInput::Cancel => {
                let in_stream = self.head_delivered;
                let _ = self.gate.handle_input(now, GateInput::ClientDisconnected);
                self.drain_gate(now);
                // The gate ends without a terminal for a client that is
                // gone; a cancelled response still gets its one terminal.
                self.deliver_terminal(Delivery::Fail {
                    kind: GateFailure::Attempt(FailureCode::Canceled),
                    in_stream,
                    provider: None,
                });
            }
        }
    }

    /// The store answered the journal write in flight.
    fn on_journaled(&mut self, now: Instant, ack: JournalAck) {
        let Some(publisher) = self.publisher.as_mut() else {
            return;
        };
        publisher.ack(ack);
        self.ack_marks();
        let Some(publisher) = self.publisher.as_mut() else {
            return;
        };
        if let Some(error) = publisher.refused().cloned() {
            let fenced = matches!(error, JournalError::Fenced { .. });
            if fenced {
                self.record_taken = true;
            }
            // Nothing unjournaled reaches the client (R-JRN-1): the run
            // stops and the client gets one error terminal outside the
            // journal, unless the write was fenced (the record goes on
            // under the Edge that took it over).
            let next = publisher.after_refusal(Terminal {
                status: RecordStatus::Failed,
                reason: Some(journal_failure_reason(&error).to_owned()),
                message: None,
                at_unix_ms: 0,
            });
            if next == AfterRefusal::RetryTerminalLater {
                // R-JRN-4: the record still gets its terminal; the store
                // gets a moment first.
                self.journal_retry_at = Some(now.saturating_add(JOURNAL_RETRY));
                self.pump_journal();
                return;
            }
            if next == AfterRefusal::GiveUp {
                publisher.discard();
            }
            // Neither the refused remainder nor what waited behind it is
            // published (a fallback terminal replaces it).
            self.usage_unpublished = true;
            if self.phase != Phase::Ended {
                let _ = self.gate.handle_input(now, GateInput::ClientDisconnected);
                self.drain_gate(now);
            }
            if fenced {
                // The record is another Edge's: its terminal is that
                // Edge's to write, and no terminal from here may reach a
                // client (R-JRN-1). Its readers follow the record.
                if !std::mem::replace(&mut self.journal_failure_delivered, true) {
                    self.outputs
                        .push_back(RequestOutput::Observe(RequestObservation::RecordTaken));
                }
            } else if !std::mem::replace(&mut self.journal_failure_delivered, true) {
                self.outputs
                    .push_back(RequestOutput::Deliver(Delivery::Fail {
                        kind: GateFailure::Attempt(FailureCode::Internal),
                        in_stream: self.head_delivered,
                        provider: None,
                    }));
            }
        }
        self.pump_journal();
    }

    /// Deliver to the client: at once for an ephemeral request, through
    /// the journal for a durable one.
    fn deliver(&mut self, mut delivery: Delivery) {
        match &mut delivery {
            Delivery::Event(RunEventKind::TextDelta(text)) => self.delivered_text.push_str(text),
            Delivery::Event(event @ RunEventKind::ToolCallDelta(_)) => {
                // R-CONT-1: never continued while a tool call is partly out.
                self.gate.set_continuation(false);
                self.attempt_other_chars = self
                    .attempt_other_chars
                    .saturating_add(crate::edge::prompt_estimate::other_output_chars(event));
            }
            Delivery::Event(event @ RunEventKind::ReasoningDelta(_)) => {
                self.attempt_other_chars = self
                    .attempt_other_chars
                    .saturating_add(crate::edge::prompt_estimate::other_output_chars(event));
            }
            Delivery::Event(RunEventKind::Usage(usage)) => {
                self.attempt_usage = Some(*usage);
                if let Some(sum) = sum_usage(self.usage_carry, Some(*usage)) {
                    *usage = sum;
                }
            }
            Delivery::Event(RunEventKind::Completed { usage, .. }) => {
                if usage.is_some() {
                    self.attempt_usage = *usage;
                }
                if self.usage_carry.is_some() {
                    *usage = sum_usage(self.usage_carry, *usage);
                }
            }
            _ => {}
        }
        match self.publisher.as_mut() {
            None => self.outputs.push_back(RequestOutput::Deliver(delivery)),
            Some(publisher) => {
                publisher.push_from(delivery, self.source.clone());
                self.pump_journal();
            }
        }
    }

    /// Move what the journal allows into the outputs: durable deliveries,
    /// then the next write.
    fn pump_journal(&mut self) {
        let Some(publisher) = self.publisher.as_mut() else {
            return;
        };
        while let Some(delivery) = publisher.poll_publish() {
            self.outputs.push_back(RequestOutput::Deliver(delivery));
        }
        if let Some(write) = publisher.poll_write() {
            self.outputs.push_back(RequestOutput::Journal(write));
        }
    }

    /// The current attempt ends (R-TEN-2): without a usage report, the
    /// text it delivered is charged by an estimate, and its prompt too if
    /// its provider accepted it.
    fn end_attempt_metering(&mut self) {
        let ended = self.current_unmetered();
        self.unmetered_input_tokens = self.unmetered_input_tokens.saturating_add(ended.input);
        self.unmetered_output_tokens = self.unmetered_output_tokens.saturating_add(ended.output);
        self.attempt_accepted = false;
        self.attempt_text_from = self.delivered_text.len();
        self.attempt_other_chars = 0;
        // A tunnelled attempt's report, read from its bytes, is the
        // answer's with the next attempt's (R-CONT-1).
        if self.tunnel_meter.take().is_some() {
            self.usage_carry = sum_usage(self.usage_carry, self.attempt_usage.take());
        }
    }

    /// What the current attempt used that no usage report covers, so far.
    fn current_unmetered(&self) -> Unmetered {
        if self.attempt_usage.is_some() {
            return Unmetered::default();
        }
        let meter = self.tunnel_meter.as_ref();
        Unmetered {
            // A prompt the provider already counted (a Messages stream's
            // start) is charged as counted.
            input: if self.attempt_accepted {
                meter
                    .and_then(TunnelMeter::reported_input)
                    .unwrap_or(self.attempt_input_tokens)
            } else {
                0
            },
            output: text_chars(
                self.delivered_text
                    .get(self.attempt_text_from..)
                    .unwrap_or_default(),
            )
            .saturating_add(self.attempt_other_chars)
            .div_ceil(crate::edge::prompt_estimate::CHARS_PER_TOKEN)
            .saturating_add(meter.map_or(0, TunnelMeter::output_estimate)),
        }
    }

    /// The usage its provider reported that no delivery carried to the
    /// client, with the earlier attempts' (R-TEN-2, R-CONT-1), so the
    /// request settles with it: a tunnelled answer's, reported in the
    /// provider's own format (read by the request's [`TunnelMeter`]; the
    /// client reads the provider's bytes), and a durable answer's whose
    /// journal write the store refused (the report was dropped with what
    /// was not yet published, R-JRN-6; not when the record was taken over,
    /// whose new owner charges it). `None` otherwise, or when the provider
    /// reported nothing (its use is then estimated: [`Self::unmetered`]).
    pub fn relayed_usage(&self) -> Option<Usage> {
        let unpublished = self.usage_unpublished && !self.record_taken;
        if self.tunnel_meter.is_none() && !unpublished {
            return None;
        }
        self.attempt_usage?;
        sum_usage(self.usage_carry, self.attempt_usage)
    }

    /// Its answer is charged by the Edge that took its record over (a
    /// journal write was fenced, R-JRN-3): that Edge charges what the
    /// journal holds, which is everything this request published, usage
    /// reports included (R-TEN-2, R-TAKE-1). The settlement charges
    /// nothing the answer reported ([`Self::unmetered`] and
    /// [`Self::relayed_usage`] are empty too): the answer is charged
    /// once.
    pub fn answer_charged_elsewhere(&self) -> bool {
        self.record_taken
    }

    /// The record this durable request wrote is left without its
    /// terminal: the store refused it too often (R-JRN-4, R-JRN-6), and no
    /// other Edge took the record over (`false` until the request ended).
    /// Its Edge's custody ends the record instead
    /// ([`CustodyInput::RunLeftOpen`](crate::edge::custody::CustodyInput::RunLeftOpen));
    /// the request has settled its answer's use already (R-TEN-2).
    pub fn record_left_open(&self) -> bool {
        self.is_ended()
            && !self.record_taken
            && self.publisher.as_ref().is_some_and(|p| !p.is_finished())
    }

    /// The tokens no provider's usage report covers (R-TEN-2), a direct
    /// answer for the request's settlement
    /// ([`TokenUse::settled`](crate::tenant::TokenUse::settled)), once per
    /// attempt (the current one included) that ended without a usage
    /// report:
    ///
    /// * input: the prompt it sent ([`RequestSpec::prompt_tokens`], and a
    ///   continuation's answer so far by its bytes, as its reservation
    ///   estimated it), if its provider accepted it (it read the prompt:
    ///   its `Started`, a tunnel's success head, its first content);
    /// * output: the text it delivered, estimated
    ///   ([`text_tokens`](crate::edge::prompt_estimate::text_tokens)).
    ///
    /// An answer taken over carries the former Edge's attempt (the text
    /// it wrote to the journal, its prompt): charged here when no usage
    /// reached the journal and the adopted run reports none. Nothing once
    /// a journal write was fenced: the Edge that took the record over
    /// charges what the journal holds.
    pub fn unmetered(&self) -> Unmetered {
        if self.record_taken {
            return Unmetered::default();
        }
        let current = self.current_unmetered();
        #[allow(unused_mut)]
        let mut unmetered = Unmetered {
            input: self.unmetered_input_tokens.saturating_add(current.input),
            output: self.unmetered_output_tokens.saturating_add(current.output),
        };
        #[cfg(feature = "planted-bugs")]
        if self.planted(PlantedBug::CutInputNotCharged) {
            unmetered.input = 0;
        }
        unmetered
    }

    /// The output tokens no usage report covers ([`Self::unmetered`]).
    pub fn unmetered_output_tokens(&self) -> u64 {
        self.unmetered().output
    }

    /// Next output, until `None`.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<RequestOutput> {
        self.outputs.pop_front()
    }

    /// When to call [`Self::handle_timeout`]: the end of the request's
    /// budget, `None` once it ended.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.phase == Phase::Ended {
            return self.journal_retry_at;
        }
        #[cfg(feature = "planted-bugs")]
        if self.planted(PlantedBug::IgnoreGateTimeout) {
            return None;
        }
        let parked = match self.phase {
            Phase::Parked { until, .. } => Some(until),
            _ => None,
        };
        crate::time::earliest(
            crate::time::earliest(self.gate.poll_timeout(), parked),
            crate::time::earliest(self.journal_retry_at, self.reserve_again_at),
        )
    }

    /// Fire the budget timer (R-GATE-3: at or after the deadline the run is
    /// canceled and the request ends).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.journal_retry_at.is_some_and(|at| now >= at) {
            self.journal_retry_at = None;
            if let Some(p) = self.publisher.as_mut() {
                p.retry_terminal();
            }
            self.pump_journal();
        }
        if self.phase == Phase::Ended {
            return;
        }
        #[cfg(feature = "planted-bugs")]
        if self.planted(PlantedBug::IgnoreGateTimeout) {
            return;
        }
        if self.phase == Phase::Reserving && self.reserve_again_at.is_some_and(|at| now >= at) {
            self.ask_reservation();
        }
        if let Phase::Parked { until, .. } = self.phase
            && now >= until
        {
            // No node reported the run in time: it is lost (R-PARK-1).
            self.adopt_failed(now);
            if self.phase == Phase::Ended {
                return;
            }
        }
        self.gate.handle_timeout(now);
        self.drain_gate(now);
    }

    /// Whether losing the current stream parks the run instead of ending
    /// the attempt: a committed durable normalized run (R-PARK-1).
    fn parks(&self) -> bool {
        self.spec.park_grace_ms > 0
            && self.publisher.is_some()
            && self.gate.is_committed()
            && matches!(self.phase, Phase::Running { tunnel: false, .. })
    }

    /// The current attempt's stream or connection is gone.
    fn lose_stream(&mut self, now: Instant, attempt: AttemptId) {
        if !self.parks() {
            self.abandon_attempt(now, attempt, AttemptEvent::TransportLost);
            return;
        }
        let Phase::Running {
            key,
            frames,
            ref lease,
            ..
        } = self.phase
        else {
            return;
        };
        self.parked_provider = Some(lease.provider_id.clone());
        self.parked_on = Some((lease.node.clone(), Some(lease.generation)));
        // Every frame received is in the journal (or on its way there):
        // an adoption resumes after the last one (R-PARK-2).
        self.outputs.push_back(RequestOutput::CloseAttempt);
        self.cancel();
        self.marks.clear();
        let grace = std::time::Duration::from_millis(self.spec.park_grace_ms);
        self.phase = Phase::Parked {
            attempt,
            key,
            resume_after: frames,
            until: now.saturating_add(grace + PARK_REPORT_SLACK),
        };
        self.observe(RequestObservation::Parked);
        if self.not_kept.take() == Some(attempt) {
            // Its node registered again without it: no report will come.
            self.observe(RequestObservation::RunNotKept);
            self.adopt_failed(now);
        }
    }

    /// A node named the runs it keeps (R-PARK-2): this request's run, lost
    /// on an earlier generation of that node and not named, is gone. A
    /// parked run's wait ends now, as when its grace ends (R-PARK-1); a
    /// running one's (its lease's fencing not heard yet) ends when its
    /// stream does. An adoption in flight is left to its own outcome.
    fn on_kept_runs(&mut self, now: Instant, kept: &KeptRuns) {
        let Some(response_id) = self.spec.journal.as_ref().map(|j| j.response_id.as_str()) else {
            return;
        };
        match &self.phase {
            Phase::Parked { key, .. } => {
                let lost_before = self.parked_on.as_ref().is_some_and(|(node, lost_on)| {
                    *node == kept.node && lost_on.is_none_or(|g| g < kept.generation)
                });
                if lost_before && !kept.keeps(*key, response_id) {
                    self.observe(RequestObservation::RunNotKept);
                    self.adopt_failed(now);
                }
            }
            Phase::Running {
                lease,
                attempt,
                key,
                tunnel: false,
                ..
            } if lease.node == kept.node
                && lease.generation < kept.generation
                && !kept.keeps(*key, response_id) =>
            {
                self.not_kept = Some(*attempt);
            }
            _ => {}
        }
    }

    /// An adoption's stream failed before it opened: wait for the run's
    /// next report (the node keeps it while its grace lasts).
    fn repark(&mut self, now: Instant) {
        let Some((attempt, adopt)) = self.adopting.take() else {
            return;
        };
        self.outputs.push_back(RequestOutput::CloseAttempt);
        self.cancel();
        let grace = std::time::Duration::from_millis(self.spec.park_grace_ms.max(1));
        self.phase = Phase::Parked {
            attempt,
            key: adopt.key,
            resume_after: adopt.resume_after_frame,
            until: now.saturating_add(grace + PARK_REPORT_SLACK),
        };
    }

    /// The parked run cannot be adopted: the attempt is lost (R-GATE-3:
    /// after commit, one in-stream error).
    fn adopt_failed(&mut self, now: Instant) {
        let attempt = match (&self.phase, self.adopting.take()) {
            (_, Some((attempt, _))) => attempt,
            (Phase::Parked { attempt, .. }, None) => *attempt,
            _ => return,
        };
        // Let go of an adoption lease, if one was granted.
        self.cancel();
        self.phase = Phase::Admitting;
        self.attempt_event(now, attempt, AttemptEvent::TransportLost);
    }

    /// Acknowledge to the node every frame whose journal events are
    /// durable (R-PARK-1).
    fn ack_marks(&mut self) {
        let Some(publisher) = self.publisher.as_ref() else {
            return;
        };
        let (durable, finished) = (publisher.durable_seq(), publisher.is_finished());
        let mut through = None;
        while let Some(&(needed, frame)) = self.marks.front() {
            let done = if needed == u64::MAX {
                finished
            } else {
                needed <= durable
            };
            if !done {
                break;
            }
            through = Some(frame);
            self.marks.pop_front();
        }
        if let Some(through_frame) = through {
            self.outputs
                .push_back(RequestOutput::AckFrames { through_frame });
        }
    }

    fn observe(&mut self, observation: RequestObservation) {
        self.outputs.push_back(RequestOutput::Observe(observation));
    }

    /// Observe the end of the attempt in flight, once.
    fn attempt_ended(&mut self, failure: Option<FailureCode>) {
        if std::mem::take(&mut self.attempt_open) {
            self.observe(RequestObservation::AttemptEnded { failure });
        }
    }

    fn admit(&mut self) {
        self.phase = Phase::Admitting;
        self.observe(RequestObservation::Admitting);
        self.outputs
            .push_back(RequestOutput::Dispatch(RequestCommand::Admit(
                DispatchRequest {
                    request_id: self.spec.request_id,
                    pool: self.spec.pool.clone(),
                    avoid_provider_id: self.avoid_provider_id.clone(),
                    allow_avoided_fallback: self.allow_avoided_fallback,
                    stall_timeout_ms: None,
                },
            )));
    }

    /// A further attempt sends the prompt again: reserve for it first
    /// (R-TEN-2), then admit it.
    fn reserve_then_admit(&mut self) {
        self.phase = Phase::Reserving;
        self.reserve_asks = 0;
        self.ask_reservation();
    }

    /// Ask for the pending further attempt's reservation (again).
    fn ask_reservation(&mut self) {
        self.reserve_asks = self.reserve_asks.saturating_add(1);
        self.reserve_again_at = None;
        // R-CONT-1: a continuation also sends the answer so far; its bytes
        // bound its tokens as a body's bound a prompt's.
        let extra_input_tokens_max = if self.continuing {
            crate::tenant::prompt_tokens_max(self.delivered_text.len() as u64)
        } else {
            0
        };
        self.outputs.push_back(RequestOutput::ReserveAttempt {
            attempt: self.gate.attempts().saturating_add(1),
            extra_input_tokens_max,
        });
    }

    fn cancel(&mut self) {
        self.outputs
            .push_back(RequestOutput::Dispatch(RequestCommand::Cancel {
                request_id: self.spec.request_id,
            }));
    }

    /// A tunnel only to a tunnel-mode provider that speaks the client's
    /// API; anything else is a normalized run.
    fn tunnel_for(&self, lease: &Lease) -> bool {
        // A continued answer is the Edge's to assemble (R-CONT-1); a
        // durable one is rendered by the Edge, numbered and replayable,
        // never a provider's own bytes (R-JRN-2).
        !self.continuing
            && self.spec.journal.is_none()
            && self
                .spec
                .tunnel_api
                .is_some_and(|api| api.spoken_by(lease.adapter))
            && self.spec.tunnel_providers.contains(&lease.provider_id)
    }

    fn on_dispatch(&mut self, now: Instant, event: RequestEvent) {
        match event {
            RequestEvent::Leased(lease) => {
                if matches!(
                    self.phase,
                    Phase::Admitting | Phase::Queued | Phase::Adopting
                ) {
                    self.phase = Phase::PreSending(lease.lease_id);
                    self.observe(RequestObservation::Leased {
                        provider_id: lease.provider_id.clone(),
                    });
                    self.outputs
                        .push_back(RequestOutput::Dispatch(RequestCommand::PreSend {
                            request_id: self.spec.request_id,
                            lease_id: lease.lease_id,
                        }));
                }
            }
            RequestEvent::Queued => {
                if self.phase == Phase::Admitting {
                    self.phase = Phase::Queued;
                }
            }
            RequestEvent::Rejected(_) if self.phase == Phase::Adopting => {
                // The hold is gone (expired, fenced): the run is lost.
                self.adopt_failed(now);
            }
            RequestEvent::Rejected(why) => {
                if self.phase == Phase::Admitting {
                    let failure = match why {
                        AdmitRejection::QueueFull => AdmissionFailure::QueueFull,
                        // R-FAIL-1: a re-admission with nowhere to go
                        // ends with its last attempt's failure (the gate).
                        AdmitRejection::NoRoute
                        | AdmitRejection::DuplicateRequest
                        | AdmitRejection::NoAlternate => AdmissionFailure::NoEligibleProvider,
                    };
                    self.observe(RequestObservation::AdmissionFailed(failure));
                    let _ = self
                        .gate
                        .handle_input(now, GateInput::AdmissionFailed(failure));
                    self.drain_gate(now);
                }
            }
            RequestEvent::QueueExpired => {
                if matches!(self.phase, Phase::Admitting | Phase::Queued) {
                    self.observe(RequestObservation::AdmissionFailed(
                        AdmissionFailure::QueueTimeout,
                    ));
                    let _ = self.gate.handle_input(
                        now,
                        GateInput::AdmissionFailed(AdmissionFailure::QueueTimeout),
                    );
                    self.drain_gate(now);
                }
            }
            RequestEvent::PreSend(answer) => self.on_pre_send(now, answer),
            RequestEvent::LeaseFenced(lease) => match &self.phase {
                // R-GEN-3: the attempt's transport is gone; a committed
                // durable run waits on its node (R-PARK-1).
                Phase::Running {
                    lease: l, attempt, ..
                } if l.lease_id == lease.lease_id => {
                    let attempt = *attempt;
                    self.lose_stream(now, attempt);
                }
                Phase::Opening { lease: l, .. }
                    if l.lease_id == lease.lease_id && self.adopting.is_some() =>
                {
                    self.repark(now);
                }
                Phase::Opening { lease: l, attempt } if l.lease_id == lease.lease_id => {
                    let attempt = *attempt;
                    self.abandon_attempt(now, attempt, AttemptEvent::TransportLost);
                }
                // Waiting for admission or a pre-send answer, a fence can
                // only be about a lease the request already gave up (or one
                // whose pre-send answer will say so): never admit twice.
                // Awaiting a verdict, the verdict says it (ignored:
                // transport lost).
                _ => {}
            },
            RequestEvent::Terminal { lease_id, verdict } => {
                // Only the verdict about the terminal this request sent.
                if let Phase::AwaitingVerdict {
                    lease_id: awaited,
                    attempt,
                    code,
                    may_fail_over,
                    retryable,
                } = self.phase
                    && awaited == lease_id
                {
                    let event = match verdict.attempt_event_with(code, may_fail_over) {
                        // R-FAIL-1: a stall the node did not mark retryable
                        // (its provider call may still be running, R-WD-4)
                        // is never re-admitted; it ends the attempt like
                        // any other failure.
                        AttemptEvent::Stalled(_) if !retryable && !self.readmits_any_stall() => {
                            AttemptEvent::Failed {
                                code: FailureCode::ResponseStalled,
                            }
                        }
                        event => event,
                    };
                    self.attempt_event(now, attempt, event);
                }
            }
        }
    }

    fn on_pre_send(&mut self, now: Instant, answer: PreSend) {
        let Phase::PreSending(lease_id) = self.phase else {
            return;
        };
        if let Some((attempt, adopt)) = self.adopting {
            // An adoption continues its attempt: no new one starts.
            match answer {
                PreSend::Send(lease) if lease.lease_id == lease_id => {
                    let left = self.gate.deadline().saturating_duration_since(now);
                    let deadline_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
                    self.phase = Phase::Opening {
                        lease: lease.clone(),
                        attempt,
                    };
                    self.outputs.push_back(RequestOutput::Open {
                        lease,
                        tunnel: false,
                        deadline_ms,
                        adopt: Some(adopt),
                        continuation: None,
                    });
                }
                PreSend::Send(_) => {}
                PreSend::Refenced | PreSend::UnknownLease => self.adopt_failed(now),
            }
            return;
        }
        match answer {
            PreSend::Send(lease) if lease.lease_id == lease_id => {
                // The attempt counts from here: opening the stream and
                // sending are part of it (R-GATE-1).
                let _ = self.gate.handle_input(
                    now,
                    GateInput::Dispatched {
                        provider_id: lease.provider_id.clone(),
                    },
                );
                let Some(attempt) = self.gate.current_attempt() else {
                    // The gate refused the attempt: it ends the request.
                    self.drain_gate(now);
                    return;
                };
                let tunnel = self.tunnel_for(&lease);
                let left = self.gate.deadline().saturating_duration_since(now);
                let deadline_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
                self.phase = Phase::Opening {
                    lease: lease.clone(),
                    attempt,
                };
                self.attempt_open = true;
                // R-TEN-2: what it sends, as its reservation estimated it.
                self.attempt_accepted = false;
                self.attempt_input_tokens =
                    self.spec.prompt_tokens.saturating_add(if self.continuing {
                        crate::tenant::prompt_tokens_max(self.delivered_text.len() as u64)
                    } else {
                        0
                    });
                self.observe(RequestObservation::AttemptStarted {
                    provider_id: lease.provider_id.clone(),
                    attempt: attempt.get(),
                });
                self.outputs.push_back(RequestOutput::Open {
                    lease,
                    tunnel,
                    deadline_ms,
                    adopt: None,
                    continuation: self.continuing.then(|| self.delivered_text.clone()),
                });
            }
            PreSend::Send(_) => {}
            // Stale: admission released the lease and re-resolves the
            // request; its next lease (or expiry) follows (R-GEN-4).
            PreSend::Refenced => self.phase = Phase::Queued,
            // The lease is gone (its generation was fenced before the
            // fence ran): let go of anything left and admit again. The
            // budget's deadline bounds the loop.
            PreSend::UnknownLease => {
                self.cancel();
                self.admit();
            }
        }
    }

    fn on_frame(&mut self, now: Instant, frame: NodeFrame) {
        let terminal_frame = match &frame {
            NodeFrame::Run(kind) => kind.is_terminal(),
            NodeFrame::Tunnel(_) => false,
        };
        if matches!(self.phase, Phase::Running { .. }) && provider_accepted(&frame) {
            // R-TEN-2: its provider read the prompt.
            self.attempt_accepted = true;
        }
        let durable_run = self.publisher.is_some() && matches!(frame, NodeFrame::Run(_));
        if durable_run
            && let Phase::Running {
                key, frames, lease, ..
            } = &mut self.phase
        {
            // R-PARK-2: each journal event records the frame it came from.
            *frames += 1;
            self.source = Some(FrameSource {
                key: *key,
                frame: *frames,
                provider_id: lease.provider_id.clone(),
            });
        }
        self.on_frame_inner(now, frame);
        if let Some(source) = self.source.take()
            && self.gate.is_committed()
        {
            // The frame is durable once the last event given out so far is
            // (a terminal frame: once the terminal is).
            let needed = match (terminal_frame, self.publisher.as_ref()) {
                (true, _) => u64::MAX,
                (false, Some(p)) => p.last_assigned(),
                (false, None) => 0,
            };
            self.marks.push_back((needed, source.frame));
            self.ack_marks();
        }
    }

    fn on_frame_inner(&mut self, now: Instant, frame: NodeFrame) {
        let Phase::Running {
            lease,
            attempt,
            tunnel,
            head_seen,
            ..
        } = &self.phase
        else {
            return;
        };
        let (attempt, tunnel, head_seen) = (*attempt, *tunnel, *head_seen);
        let (lease_id, node, generation) = (lease.lease_id, lease.node.clone(), lease.generation);
        let request_id = self.spec.request_id;
        let terminal = move |failure: Option<ExecutionFailure>| RequestCommand::Terminal {
            request_id,
            lease_id,
            node,
            generation,
            failure,
        };
        match (frame, tunnel) {
            (NodeFrame::Tunnel(frame), true) => {
                // Which frame is content (and so commits) is the gate's
                // rule (R-GATE-2).
                let class = AttemptFrame::from_tunnel_frame(&frame);
                match frame {
                    ProviderTunnelFrame::Head { status, headers } => {
                        // One head per tunnel (R-LIM-3).
                        if head_seen {
                            self.fail_attempt_malformed(now, attempt);
                            return;
                        }
                        if let Phase::Running { head_seen, .. } = &mut self.phase {
                            *head_seen = true;
                        }
                        // R-TEN-2: a success's body says what it used.
                        if let Some(api) = self.spec.tunnel_api
                            && (200..300).contains(&status)
                        {
                            self.tunnel_meter = Some(TunnelMeter::from_head(api, &headers));
                        }
                        let head = Delivery::Commit {
                            tunnel_head: Some((status, headers)),
                        };
                        if self.hold(head).is_err() {
                            self.fail_attempt_malformed(now, attempt);
                            return;
                        }
                        if let AttemptFrame::Event(event) = class {
                            self.attempt_event(now, attempt, event);
                        }
                    }
                    ProviderTunnelFrame::Body(bytes) => {
                        self.meter_tunnel(|meter| meter.feed(&bytes));
                        self.relay(now, attempt, Delivery::Body(bytes), class);
                    }
                    ProviderTunnelFrame::End => {
                        self.meter_tunnel(TunnelMeter::finish);
                        self.await_verdict(attempt, None, terminal(None));
                    }
                    ProviderTunnelFrame::Failure(f) => {
                        let code = Some(f.code);
                        self.await_verdict(attempt, code, terminal(Some(f)));
                    }
                }
            }
            (NodeFrame::Run(kind), false) => match (AttemptFrame::from_run_event(&kind), kind) {
                (AttemptFrame::Terminal, RunEventKind::Failed(f)) => {
                    let code = Some(f.code);
                    self.await_verdict(attempt, code, terminal(Some(f)));
                }
                (AttemptFrame::Terminal, completed) => {
                    // The completion carries final usage: it reaches the
                    // client before Finish whatever the commit state. It
                    // ends the attempt, so it passes the bound at most once.
                    self.push_held(Delivery::Event(completed));
                    self.await_verdict(attempt, None, terminal(None));
                }
                // A start is the gate's alone.
                (AttemptFrame::Event(AttemptEvent::Started), _) => {
                    self.attempt_event(now, attempt, AttemptEvent::Started);
                }
                // An empty delta is nothing to relay.
                (AttemptFrame::NoEvent, RunEventKind::TextDelta(text)) if text.is_empty() => {}
                (class, kind) => self.relay(now, attempt, Delivery::Event(kind), class),
            },
            // A frame of the other kind than the attempt's stream carries is
            // the node's protocol error.
            (NodeFrame::Tunnel(_), false) | (NodeFrame::Run(_), true) => {
                self.fail_attempt_malformed(now, attempt);
            }
        }
    }

    /// Read a tunnelled answer's bytes (R-TEN-2): a usage its provider
    /// reported is the attempt's.
    fn meter_tunnel(&mut self, read: impl FnOnce(&mut TunnelMeter)) {
        if let Some(meter) = self.tunnel_meter.as_mut() {
            read(meter);
            if let Some(usage) = meter.usage() {
                self.attempt_usage = Some(usage);
            }
        }
    }

    /// Forward `delivery` after commit, hold it before; then feed the
    /// frame's gate event (content commits, R-GATE-2).
    fn relay(&mut self, now: Instant, attempt: AttemptId, delivery: Delivery, class: AttemptFrame) {
        let content = class == AttemptFrame::Event(AttemptEvent::Content);
        if self.gate.is_committed() {
            self.deliver(delivery);
        } else if content {
            // The gate commits on it right away, so it never stays held and
            // is not counted against the bound.
            self.push_held(delivery);
        } else if self.hold(delivery).is_err() {
            self.fail_attempt_malformed(now, attempt);
            return;
        }
        if let AttemptFrame::Event(event) = class {
            self.attempt_event(now, attempt, event);
        }
    }

    fn await_verdict(
        &mut self,
        attempt: AttemptId,
        code: Option<FailureCode>,
        mut command: RequestCommand,
    ) {
        let RequestCommand::Terminal {
            lease_id, failure, ..
        } = &mut command
        else {
            return;
        };
        self.provider_said = failure.as_ref().and_then(ProviderSaid::of);
        // The provider's words are the client's alone: the dispatcher (and
        // its trace) decides from the failure's class.
        if let Some(failure) = failure.as_mut() {
            failure.provider_message = None;
        }
        self.phase = Phase::AwaitingVerdict {
            lease_id: *lease_id,
            attempt,
            code,
            may_fail_over: failure.as_ref().is_some_and(failure_may_fail_over),
            retryable: failure.as_ref().is_some_and(|f| f.retryable),
        };
        self.outputs.push_back(RequestOutput::Dispatch(command));
    }

    /// What the provider said, when the request ends with `kind` on a
    /// provider's error: the last attempt's (the one `kind` is of).
    fn provider_said_for(&mut self, kind: GateFailure) -> Option<ProviderSaid> {
        match kind {
            GateFailure::Attempt(FailureCode::ProviderError) => self.provider_said.take(),
            _ => None,
        }
    }

    /// The node broke the attempt's protocol or the pre-commit bound.
    fn fail_attempt_malformed(&mut self, now: Instant, attempt: AttemptId) {
        self.abandon_attempt(
            now,
            attempt,
            AttemptEvent::Failed {
                code: FailureCode::MalformedResponse,
            },
        );
    }

    /// End the attempt without an applied terminal: close its stream, let go
    /// of its lease (the node run is canceled), then feed `event`.
    fn abandon_attempt(&mut self, now: Instant, attempt: AttemptId, event: AttemptEvent) {
        if self.has_stream() {
            self.outputs.push_back(RequestOutput::CloseAttempt);
        }
        self.cancel();
        self.attempt_event(now, attempt, event);
    }

    fn attempt_event(&mut self, now: Instant, attempt: AttemptId, event: AttemptEvent) {
        let ended = match &event {
            AttemptEvent::Completed => Some(None),
            AttemptEvent::Stalled(_) => Some(Some(FailureCode::ResponseStalled)),
            AttemptEvent::Failed { code } | AttemptEvent::FailedRetryable { code } => {
                Some(Some(*code))
            }
            AttemptEvent::TransportLost => Some(Some(FailureCode::TransportClosed)),
            AttemptEvent::Started | AttemptEvent::Content => None,
        };
        let ends_attempt = ended.is_some();
        if let Some(failure) = ended {
            self.attempt_ended(failure);
        }
        let _ = self
            .gate
            .handle_input(now, GateInput::Attempt { attempt, event });
        self.drain_gate(now);
        if ends_attempt
            && self.phase != Phase::Ended
            && !matches!(self.phase, Phase::Admitting | Phase::Reserving)
        {
            // The gate always ends or re-admits after an attempt ends.
            debug_assert!(false, "an ended attempt left the request running");
            self.end();
        }
    }

    /// Carry out the gate's outputs.
    fn drain_gate(&mut self, _now: Instant) {
        while let Some(event) = self.gate.poll_event() {
            self.outputs
                .push_back(RequestOutput::Observe(RequestObservation::Gate(event)));
        }
        while let Some(out) = self.gate.poll_output() {
            match out {
                GateOutput::Commit => {
                    self.outputs
                        .push_back(RequestOutput::Observe(RequestObservation::Committed));
                    self.deliver_head();
                    self.flush_held();
                }
                GateOutput::CloseTransport { .. } => {
                    // R-GATE-2: the old transport is closed before
                    // re-admission.
                    if self.has_stream() {
                        self.outputs.push_back(RequestOutput::CloseAttempt);
                    }
                    self.clear_held();
                }
                GateOutput::Readmit {
                    avoid_provider_id,
                    allow_avoided_fallback,
                } => {
                    self.outputs
                        .push_back(RequestOutput::Observe(RequestObservation::Readmitted));
                    self.avoid_provider_id = Some(avoid_provider_id);
                    self.allow_avoided_fallback = allow_avoided_fallback;
                    // R-TEN-2: the failed attempt's prompt, if its
                    // provider accepted it.
                    self.end_attempt_metering();
                    // Whatever the old attempt still holds goes first.
                    self.cancel();
                    self.reserve_then_admit();
                }
                GateOutput::Continue { avoid_provider_id } => {
                    // R-CONT-1: another provider continues the answer.
                    self.outputs
                        .push_back(RequestOutput::Observe(RequestObservation::Readmitted));
                    self.avoid_provider_id = Some(avoid_provider_id);
                    // An answer whose run is gone (a takeover) may go back
                    // to its provider: that one did not fail, its Edge did.
                    self.allow_avoided_fallback = std::mem::take(&mut self.orphan_continuation);
                    self.continuing = true;
                    self.end_attempt_metering();
                    self.usage_carry = sum_usage(self.usage_carry, self.attempt_usage.take());
                    self.cancel();
                    self.reserve_then_admit();
                }
                GateOutput::CancelRun { .. } => {
                    // R-GATE-4: reset the stream; the cancel at the end
                    // releases the lease and cancels the node run.
                    if self.has_stream() {
                        self.outputs.push_back(RequestOutput::CloseAttempt);
                    }
                }
                GateOutput::Finish => {
                    self.deliver_head();
                    let held: Vec<Delivery> = self.held.drain(..).collect();
                    self.held_bytes = 0;
                    for d in held {
                        if !matches!(d, Delivery::Commit { .. }) {
                            self.deliver(d);
                        }
                    }
                    self.deliver_terminal(Delivery::Finish);
                }
                GateOutput::FailBeforeCommit { kind } => {
                    self.clear_held();
                    let provider = self.provider_said_for(kind);
                    self.deliver_terminal(Delivery::Fail {
                        kind,
                        in_stream: false,
                        provider,
                    });
                }
                GateOutput::FailInStream { kind } => {
                    let provider = self.provider_said_for(kind);
                    self.deliver_terminal(Delivery::Fail {
                        kind,
                        in_stream: true,
                        provider,
                    });
                }
            }
        }
        if self.gate.end().is_some() {
            self.end();
        }
    }

    /// The request is over: let go of whatever it still holds, once.
    fn end(&mut self) {
        if self.phase != Phase::Ended {
            self.phase = Phase::Ended;
            // An attempt cut short by the client or the budget.
            self.attempt_ended(Some(FailureCode::Canceled));
            let attempts = self.gate.attempts();
            self.observe(RequestObservation::Ended { attempts });
            #[cfg(feature = "planted-bugs")]
            if self.planted(PlantedBug::SkipCancelRelease) {
                self.clear_held();
                return;
            }
            self.cancel();
            self.clear_held();
        }
    }

    /// Deliver the one terminal (R-GATE-3).
    fn deliver_terminal(&mut self, delivery: Delivery) {
        #[cfg(feature = "planted-bugs")]
        if self.planted(PlantedBug::DuplicateTerminal) {
            self.outputs
                .push_back(RequestOutput::Deliver(delivery.clone()));
        }
        self.deliver(delivery);
    }

    /// Send the response head, once: a tunnel's own if one is held.
    fn deliver_head(&mut self) {
        if self.head_delivered {
            return;
        }
        self.head_delivered = true;
        let head = self
            .held
            .iter()
            .position(|d| matches!(d, Delivery::Commit { .. }))
            .and_then(|i| self.held.remove(i))
            .unwrap_or(Delivery::Commit { tunnel_head: None });
        self.deliver(head);
    }

    fn flush_held(&mut self) {
        while let Some(d) = self.held.pop_front() {
            self.deliver(d);
        }
        self.held_bytes = 0;
    }

    fn clear_held(&mut self) {
        self.held.clear();
        self.held_bytes = 0;
    }

    fn push_held(&mut self, d: Delivery) {
        self.held_bytes = self.held_bytes.saturating_add(delivery_bytes(&d));
        self.held.push_back(d);
    }

    /// Hold `d` until commit, within [`MAX_HELD_DELIVERIES`] and
    /// [`MAX_HELD_BYTES`].
    fn hold(&mut self, d: Delivery) -> Result<(), HeldOverflow> {
        let bytes = delivery_bytes(&d);
        if self.held.len() >= MAX_HELD_DELIVERIES
            || self.held_bytes.saturating_add(bytes) > MAX_HELD_BYTES
        {
            return Err(HeldOverflow);
        }
        self.push_held(d);
        Ok(())
    }
}

/// Whether `frame` shows that its attempt's provider accepted the request
/// and so read its prompt (R-TEN-2): its `Started` (sent only on a success
/// status), content or usage of a run, a tunnel's success head.
fn provider_accepted(frame: &NodeFrame) -> bool {
    match frame {
        NodeFrame::Run(kind) => matches!(
            kind,
            RunEventKind::Started { .. }
                | RunEventKind::TextDelta(_)
                | RunEventKind::ToolCallDelta(_)
                | RunEventKind::ReasoningDelta(_)
                | RunEventKind::Embedding(_)
                | RunEventKind::Usage(_)
        ),
        NodeFrame::Tunnel(ProviderTunnelFrame::Head { status, .. }) => (200..300).contains(status),
        NodeFrame::Tunnel(_) => false,
    }
}

/// The sum of two usage reports (R-CONT-1: a continued answer's usage is
/// its attempts' together); `None` when neither reported any. A cache
/// count is the sum of the counts reported: one attempt's alone when only
/// it reported one (what is known, never invented).
fn text_chars(text: &str) -> u64 {
    text.chars().count() as u64
}

fn sum_usage(a: Option<Usage>, b: Option<Usage>) -> Option<Usage> {
    fn sum_reported(a: Option<u64>, b: Option<u64>) -> Option<u64> {
        match (a, b) {
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
            (a, b) => a.or(b),
        }
    }
    match (a, b) {
        (Some(a), Some(b)) => Some(Usage {
            prompt_tokens: a.prompt_tokens.saturating_add(b.prompt_tokens),
            completion_tokens: a.completion_tokens.saturating_add(b.completion_tokens),
            cache_read_tokens: sum_reported(a.cache_read_tokens, b.cache_read_tokens),
            cache_write_tokens: sum_reported(a.cache_write_tokens, b.cache_write_tokens),
        }),
        (a, b) => a.or(b),
    }
}

/// The closed reason a record ends with when the journal refused a write.
fn journal_failure_reason(error: &JournalError) -> &'static str {
    match error {
        JournalError::RecordTooLarge => "response_too_large",
        _ => crate::journal::JOURNAL_UNAVAILABLE_REASON,
    }
}

/// The decoded size of a held delivery, for [`MAX_HELD_BYTES`].
fn delivery_bytes(d: &Delivery) -> usize {
    let payload = match d {
        Delivery::Commit {
            tunnel_head: Some((_, headers)),
        } => headers
            .iter()
            .map(|(name, value)| name.len().saturating_add(value.len()))
            .fold(0usize, usize::saturating_add),
        Delivery::Body(bytes) => bytes.len(),
        Delivery::Event(kind) => run_event_bytes(kind),
        Delivery::Commit { tunnel_head: None } | Delivery::Finish | Delivery::Fail { .. } => 0,
    };
    HELD_ITEM_OVERHEAD.saturating_add(payload)
}

/// The decoded size of a run event's variable parts.
fn run_event_bytes(kind: &RunEventKind) -> usize {
    match kind {
        RunEventKind::TextDelta(text) => text.len(),
        RunEventKind::ToolCallDelta(call) => {
            postcard::experimental::serialized_size(call).unwrap_or(usize::MAX / 2)
        }
        other => postcard::experimental::serialized_size(other).unwrap_or(usize::MAX / 2),
    }
}

#[cfg(test)]
mod tests;
