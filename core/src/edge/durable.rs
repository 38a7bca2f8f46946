//! Publish after durable (R-JRN-1, R-JRN-2, R-JRN-4), as the part of a
//! [`Request`](crate::edge::request::Request) that a durable response
//! switches on.
//!
//! Every delivery of a durable response passes through a [`Publisher`]:
//! content gets the next event number and waits until its append is
//! acknowledged as durable; the one terminal waits until it is written.
//! Only then does the delivery reach the client. Appends are batched: all
//! deliveries that arrive while one append is being synced go in the next
//! one (group commit per response; the store batches across responses).
//! A refused write (fenced epoch, full record, failed store) publishes
//! nothing more from the journal.

use std::collections::VecDeque;
use std::time::Duration;

use iop_wire::{FailureCode, RunKey};

use crate::ids::ProviderId;

use crate::edge::delivery::{Delivery, ProviderSaid};
use crate::edge::gate::GateFailure;
use crate::journal::{JournalError, JournalEvent, RecordStatus, Terminal};
use crate::time::Instant;

/// Most events one append carries.
pub const MAX_EVENTS_PER_APPEND: usize = 256;

/// Most payload bytes one append carries (past its first event).
pub const MAX_BYTES_PER_APPEND: usize = 256 * 1024;

/// Deliveries waiting for durability past which the request stops reading
/// its node stream (back-pressure on the provider, R-LIM-4).
pub const MAX_UNPUBLISHED: usize = 4096;

/// Which record a durable request writes, and as which writer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournalSpec {
    /// The record's id (the response id).
    pub response_id: String,
    /// The writer epoch every write carries (R-JRN-3).
    pub epoch: u64,
    /// Nobody reads the answer as it streams (the client asked for the
    /// whole answer, or runs it in the background): its events are written
    /// together with the last of them, in appends of at most
    /// [`MAX_BYTES_PER_APPEND`], rather than as they come. Nothing is
    /// published before the terminal either way, so this saves syncs, not
    /// safety: the node keeps every frame until it is acknowledged.
    #[serde(default)]
    pub batch_until_terminal: bool,
}

/// A write for the store. Answer with [`JournalAck`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalWrite {
    /// Append these numbered events.
    Append {
        /// The record.
        response_id: String,
        /// The writer epoch.
        epoch: u64,
        /// Events, numbered without gap from the record's last one.
        events: Vec<JournalEvent>,
    },
    /// Write the record's terminal. `terminal.at_unix_ms` is 0: the driver
    /// stamps the wall-clock time before writing (core reads no clock).
    Finish {
        /// The record.
        response_id: String,
        /// The writer epoch.
        epoch: u64,
        /// The terminal.
        terminal: Terminal,
    },
}

/// The store's answer to the pending [`JournalWrite`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalAck {
    /// The append is durable.
    Appended,
    /// The terminal is durable.
    Finished,
    /// The store refused the write.
    Refused(JournalError),
}

/// Which node frame a journal event came from: the run (by the identity
/// it keeps for life, R-PARK-2) and the frame's number in it. An Edge that
/// adopts the run resumes after the last frame its journal holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FrameSource {
    /// The run.
    pub key: RunKey,
    /// Its frame, from 1.
    pub frame: u64,
    /// The provider it ran on: only a report of that provider's node can
    /// take the run over (R-PARK-2).
    pub provider_id: ProviderId,
}

/// What one journal event holds: a delivery and the frame it came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournalEntry {
    /// The delivery.
    pub delivery: Delivery,
    /// Its node frame, when it came from one.
    pub source: Option<FrameSource>,
}

/// The format byte in front of every encoded [`JournalEntry`]: 2 since
/// [`iop_wire::Usage`] carries the prompt cache's counts. Records an
/// earlier build wrote hold format 1, still read ([`legacy`]).
const ENTRY_FORMAT: u8 = 2;

/// The format of entries written before [`ENTRY_FORMAT`] 2.
const ENTRY_FORMAT_V1: u8 = 1;

/// Encode a journal event payload.
pub fn encode_entry(delivery: &Delivery, source: Option<FrameSource>) -> Vec<u8> {
    let entry = JournalEntry {
        delivery: delivery.clone(),
        source,
    };
    // Plain data: postcard cannot fail on it short of running out of memory.
    let mut out = vec![ENTRY_FORMAT];
    out.extend(postcard::to_allocvec(&entry).unwrap_or_default());
    out
}

/// Decode a journal event payload, of this build's format or an earlier
/// one; `None` for bytes this build does not understand.
pub fn decode_entry(payload: &[u8]) -> Option<JournalEntry> {
    match payload.split_first() {
        Some((&ENTRY_FORMAT, rest)) => postcard::from_bytes(rest).ok(),
        Some((&ENTRY_FORMAT_V1, rest)) => postcard::from_bytes::<legacy::JournalEntryV1>(rest)
            .ok()
            .map(legacy::JournalEntryV1::upgrade),
        _ => None,
    }
}

/// Encode a delivery with no frame as a journal event payload.
pub fn encode_delivery(delivery: &Delivery) -> Vec<u8> {
    encode_entry(delivery, None)
}

/// The delivery of a journal event payload.
pub fn decode_delivery(payload: &[u8]) -> Option<Delivery> {
    decode_entry(payload).map(|e| e.delivery)
}

/// The reason of a record that failed on a provider's error answered with
/// an HTTP status: this prefix and the status (`provider_error_http_422`),
/// so a replay answers the class the live request was answered with.
pub const PROVIDER_STATUS_REASON_PREFIX: &str = "provider_error_http_";

/// The record terminal a terminal delivery stands for. A provider's error
/// keeps what the provider said: its message, and its HTTP status in the
/// reason ([`PROVIDER_STATUS_REASON_PREFIX`]); [`failure_of`] reads it
/// back.
pub fn terminal_of(delivery: &Delivery) -> Option<Terminal> {
    let (status, reason, message) = match delivery {
        Delivery::Finish => (RecordStatus::Completed, None, None),
        Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::Canceled),
            ..
        } => (RecordStatus::Cancelled, Some("cancelled".to_owned()), None),
        Delivery::Fail { kind, provider, .. } => {
            let reason = match provider.as_ref().and_then(|p| p.http_status) {
                Some(status) if *kind == GateFailure::Attempt(FailureCode::ProviderError) => {
                    format!("{PROVIDER_STATUS_REASON_PREFIX}{status}")
                }
                _ => kind.as_str().to_owned(),
            };
            let message = provider.as_ref().and_then(|p| p.message.clone());
            (RecordStatus::Failed, Some(reason), message)
        }
        _ => return None,
    };
    Some(Terminal {
        status,
        reason,
        message,
        at_unix_ms: 0,
    })
}

/// The failure a failed record's terminal stands for ([`terminal_of`]'s
/// inverse): why, and what the provider said; `None` for a reason this
/// build does not know.
pub fn failure_of(terminal: &Terminal) -> Option<(GateFailure, Option<ProviderSaid>)> {
    let reason = terminal.reason.as_deref()?;
    let said = |http_status: Option<u16>| ProviderSaid {
        http_status,
        message: terminal.message.clone(),
    };
    let provider_error = GateFailure::Attempt(FailureCode::ProviderError);
    if let Some(status) = reason.strip_prefix(PROVIDER_STATUS_REASON_PREFIX) {
        let status = status.parse::<u16>().ok()?;
        return Some((provider_error, Some(said(Some(status)))));
    }
    let kind = GateFailure::parse(reason)?;
    let provider = (kind == provider_error && terminal.message.is_some()).then(|| said(None));
    Some((kind, provider))
}

/// Whether an answer read from the journal is an HTTP error rather than
/// a stream (R-GATE-3, as a live request before its commit): the record
/// ended without completing before any of its events was taken. A record
/// with events, or a completed one, streams, and its terminal comes in
/// the stream.
pub fn ended_before_commit(terminal: &Terminal, events_taken: u64) -> bool {
    terminal.status != RecordStatus::Completed && events_taken == 0
}

/// Why an Edge does not take over the record of a parked run a node
/// reported (R-PARK-2, R-TAKE-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TakeoverRefusal {
    /// The record already has its terminal.
    Ended,
    /// The record's last event came from no node frame this build reads.
    NoFrameSource,
    /// The record's last event came from another run, or from this run on
    /// another provider: the report cannot name this record into its run.
    AnotherRun,
}

impl TakeoverRefusal {
    /// The closed label for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            TakeoverRefusal::Ended => "response_ended",
            TakeoverRefusal::NoFrameSource => "no_frame_source",
            TakeoverRefusal::AnotherRun => "another_run",
        }
    }
}

/// The frame of `offer`'s run after which an Edge that takes its record
/// over resumes (R-PARK-2, R-TAKE-1): the frame the record's last event
/// came from. `last` is the payload of the record's event `meta.last_seq`
/// (`None` when it holds none). A run whose frames the journal already
/// holds is taken over only from the provider that ran it: a report
/// cannot name someone else's answer into its run.
///
/// A record that holds no event yet is taken over from the run's first
/// frame (`0`): its Edge died after starting the run and before journaling
/// any of it, the run is the answer's only source, and refusing it would
/// end the record `incomplete` with nothing, freeing its idempotency key
/// for a retry that calls a provider again (R-IDEM-1). Its report names
/// the record's id, which a node learns only from the run start an Edge
/// sent it for that record (an id is random; logs show only its tag).
///
/// The caller asks again on the record it reads after winning the epoch
/// (R-JRN-3), since the former writer may have appended in between.
pub fn takeover_resume_point(
    meta: &crate::journal::RecordMeta,
    last: Option<&[u8]>,
    offer: &crate::edge::dispatch::ParkedOffer,
) -> Result<u64, TakeoverRefusal> {
    if meta.terminal.is_some() {
        return Err(TakeoverRefusal::Ended);
    }
    if meta.last_seq == 0 {
        #[cfg(feature = "planted-bugs")]
        if crate::planted::in_thread(crate::planted::PlantedBug::RefuseUnjournaledPark) {
            return Err(TakeoverRefusal::NoFrameSource);
        }
        return Ok(0);
    }
    let source = last
        .and_then(decode_entry)
        .and_then(|e| e.source)
        .ok_or(TakeoverRefusal::NoFrameSource)?;
    if source.key != offer.run.key || source.provider_id != offer.provider_id {
        return Err(TakeoverRefusal::AnotherRun);
    }
    Ok(source.frame)
}

/// What a record's journal holds of an answer whose run is gone, for a
/// takeover that continues it on a provider (R-TAKE-1, R-CONT-1).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResumedAnswer {
    /// Events durable in the record; the continuation numbers on from here.
    pub last_seq: u64,
    /// The answer's text so far: the continuation's partial assistant
    /// message.
    pub text: String,
    /// The provider the last frame came from (the one to avoid first).
    pub provider_id: Option<ProviderId>,
    /// The usage last journaled (the sum of the attempts so far).
    pub usage: Option<iop_wire::Usage>,
}

/// Why a record's journal cannot be continued (R-CONT-1, R-TAKE-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NotContinuable {
    /// An event this build does not read, or a gap in the numbering.
    Unreadable,
    /// A tool call went out: never continued while one is partly emitted.
    ToolCall,
    /// No text yet: continuing would send the prompt again from scratch,
    /// which a takeover never does.
    NoText,
    /// The record already holds its end.
    Ended,
}

impl NotContinuable {
    /// The closed label for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            NotContinuable::Unreadable => "unreadable",
            NotContinuable::ToolCall => "tool_call",
            NotContinuable::NoText => "no_text",
            NotContinuable::Ended => "ended",
        }
    }
}

/// What the journal `events` (the record's, from event 1, in order) hold
/// of an answer a takeover may continue on another provider (R-TAKE-1,
/// R-CONT-1): its text, the provider of its last frame and the usage so
/// far. Refused for an answer with a tool call, without text, with an
/// end, or with events this build does not read.
pub fn resumed_answer(events: &[JournalEvent]) -> Result<ResumedAnswer, NotContinuable> {
    let mut resumed = ResumedAnswer {
        last_seq: 0,
        text: String::new(),
        provider_id: None,
        usage: None,
    };
    for event in events {
        if event.seq != resumed.last_seq + 1 {
            return Err(NotContinuable::Unreadable);
        }
        resumed.last_seq = event.seq;
        let entry = decode_entry(&event.payload).ok_or(NotContinuable::Unreadable)?;
        if let Some(source) = entry.source {
            resumed.provider_id = Some(source.provider_id);
        }
        match entry.delivery {
            Delivery::Event(iop_wire::RunEventKind::TextDelta(text)) => {
                resumed.text.push_str(&text)
            }
            Delivery::Event(iop_wire::RunEventKind::ToolCallDelta(_)) => {
                return Err(NotContinuable::ToolCall);
            }
            Delivery::Event(iop_wire::RunEventKind::Usage(usage)) => resumed.usage = Some(usage),
            Delivery::Event(
                iop_wire::RunEventKind::Completed { .. } | iop_wire::RunEventKind::Failed(_),
            )
            | Delivery::Finish
            | Delivery::Fail { .. } => return Err(NotContinuable::Ended),
            // A tunnelled body is never journaled (R-JRN-2); reasoning,
            // log probabilities and the rest are not carried over.
            Delivery::Body(_) => return Err(NotContinuable::Unreadable),
            _ => {}
        }
    }
    if resumed.text.is_empty() {
        return Err(NotContinuable::NoText);
    }
    Ok(resumed)
}

/// The end the journal `events` (the record's, in order) already hold,
/// if its writer journaled the answer's last delivery and died before
/// writing the record's terminal (R-TAKE-1, R-JRN-3): the terminal that
/// delivery stands for ([`terminal_of`]; a run's `Completed` event stands
/// for a completed answer). A takeover ends such a record with it, never
/// `incomplete`: the answer is whole in the journal.
pub fn journaled_terminal(events: &[JournalEvent]) -> Option<Terminal> {
    events.iter().find_map(|event| {
        let delivery = decode_delivery(&event.payload)?;
        match delivery {
            Delivery::Event(iop_wire::RunEventKind::Completed { .. }) => {
                terminal_of(&Delivery::Finish)
            }
            other => terminal_of(&other),
        }
    })
}

/// What a record's journal holds that its answer is charged by when no
/// run of it settles (R-TEN-2): a takeover ends it `incomplete` without
/// running it ([`crate::edge::custody::CustodyOutput::Charge`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournaledUse {
    /// The usage last journaled (the sum of the attempts' reports so
    /// far), if any.
    pub usage: Option<iop_wire::Usage>,
    /// The estimated tokens
    /// ([`text_tokens`](crate::edge::prompt_estimate::text_tokens)) of the
    /// text journaled after that usage (all of it without one).
    pub text_tokens: u64,
}

impl JournaledUse {
    /// What the answer is charged (R-TEN-2), its prompt estimated as its
    /// reservation did (`prompt_tokens`, from above): the usage journaled
    /// and the estimate of the text after it; without a usage journaled,
    /// the prompt too (the attempt that wrote the text was accepted by its
    /// provider and reported nothing). `None`: nothing to charge (no text
    /// and no usage journaled: no provider answered).
    pub fn charged(&self, prompt_tokens: u64) -> Option<crate::tenant::TokenUse> {
        let reported = self.usage.as_ref().map(crate::tenant::TokenUse::of_usage);
        if reported.is_none() && self.text_tokens == 0 {
            return None;
        }
        crate::tenant::TokenUse::settled(
            reported,
            crate::tenant::Unmetered {
                input: if reported.is_some() { 0 } else { prompt_tokens },
                output: self.text_tokens,
            },
        )
    }
}

/// What the journal `events` (a record's, in order) hold that its answer
/// is charged by (R-TEN-2): the last usage journaled and the output after
/// it, every text, reasoning and tool-call delta counted (an event this
/// build does not read does not stop the count: it is an estimate, never
/// a refusal).
pub fn journaled_use(events: &[JournalEvent]) -> JournaledUse {
    let mut usage = None;
    // Characters of the text after the last usage (the estimate is of
    // the text whole, as the request machine's).
    let mut chars: u64 = 0;
    for event in events {
        let Some(entry) = decode_entry(&event.payload) else {
            continue;
        };
        match entry.delivery {
            Delivery::Event(iop_wire::RunEventKind::TextDelta(text)) => {
                chars = chars.saturating_add(text.chars().count() as u64);
            }
            Delivery::Event(
                event @ (iop_wire::RunEventKind::ReasoningDelta(_)
                | iop_wire::RunEventKind::ToolCallDelta(_)),
            ) => {
                chars =
                    chars.saturating_add(crate::edge::prompt_estimate::other_output_chars(&event));
            }
            Delivery::Event(iop_wire::RunEventKind::Usage(reported))
            | Delivery::Event(iop_wire::RunEventKind::Completed {
                usage: Some(reported),
                ..
            }) => {
                usage = Some(reported);
                chars = 0;
            }
            _ => {}
        }
    }
    JournaledUse {
        usage,
        text_tokens: chars.div_ceil(crate::edge::prompt_estimate::CHARS_PER_TOKEN),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InFlight {
    /// An append of events up to this number.
    Append(u64),
    /// The terminal.
    Finish,
}

/// The publish-after-durable queue of one response (see the module docs).
#[derive(Debug)]
pub struct Publisher {
    spec: JournalSpec,
    /// The number the next event gets.
    next_seq: u64,
    /// The last event acknowledged durable.
    durable_seq: u64,
    /// Deliveries not yet published, with their event number (0 for those
    /// that are not journal events: the head, the terminal).
    waiting: VecDeque<(u64, Delivery)>,
    /// Events numbered but not yet sent to the store.
    unwritten: VecDeque<JournalEvent>,
    /// The terminal, once known, and whether it was sent.
    terminal: Option<(Terminal, bool)>,
    /// The terminal is durable.
    finished: bool,
    in_flight: Option<InFlight>,
    /// The store refused a write: nothing more is written or published
    /// from the journal.
    refused: Option<JournalError>,
    /// The refused write was the terminal.
    refused_terminal: bool,
    /// Terminal writes issued so far.
    terminal_writes: u32,
    /// A refused terminal waits to be written again.
    terminal_delayed: bool,
}

/// The most times a record's terminal is written before the request gives
/// up on it (its Edge's custody ends the record then, R-JRN-4).
pub const MAX_TERMINAL_WRITES: u32 = 5;

/// What a request does after the store refused a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterRefusal {
    /// Write the terminal again later (the store failed it; R-JRN-4: the
    /// record still gets its one terminal).
    RetryTerminalLater,
    /// The record ends with the fallback terminal, written next (an append
    /// was refused: what followed it can never be written).
    WriteFallback,
    /// Nothing more is written (fenced: another writer owns the record;
    /// or the terminal was tried too often).
    GiveUp,
}

impl Publisher {
    /// A publisher for a record whose last durable event is `after` (0 for
    /// a new record).
    pub fn new(spec: JournalSpec, after: u64) -> Self {
        Publisher {
            spec,
            next_seq: after + 1,
            durable_seq: after,
            waiting: VecDeque::new(),
            unwritten: VecDeque::new(),
            terminal: None,
            finished: false,
            in_flight: None,
            refused: None,
            refused_terminal: false,
            terminal_writes: 0,
            terminal_delayed: false,
        }
    }

    /// The record this publisher writes.
    pub fn spec(&self) -> &JournalSpec {
        &self.spec
    }

    /// The last event acknowledged durable.
    pub fn durable_seq(&self) -> u64 {
        self.durable_seq
    }

    /// Deliveries waiting to be published.
    pub fn backlog(&self) -> usize {
        self.waiting.len()
    }

    /// Nothing is waiting, in flight or unwritten.
    pub fn is_idle(&self) -> bool {
        self.in_flight.is_none()
            && (self.refused.is_some()
                || (self.waiting.is_empty()
                    && self.unwritten.is_empty()
                    && self.terminal.as_ref().is_none_or(|_| self.finished)))
    }

    /// The write the store refused, if any.
    pub fn refused(&self) -> Option<&JournalError> {
        self.refused.as_ref()
    }

    /// Has the terminal been taken (written or waiting)?
    pub fn has_terminal(&self) -> bool {
        self.terminal.is_some()
    }

    /// The number of the last event given out (0: none), durable or not.
    pub fn last_assigned(&self) -> u64 {
        self.next_seq - 1
    }

    /// The terminal is durable.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Queue a delivery for publication.
    pub fn push(&mut self, delivery: Delivery) {
        self.push_from(delivery, None);
    }

    /// Queue a delivery that came from node frame `source`.
    pub fn push_from(&mut self, delivery: Delivery, source: Option<FrameSource>) {
        if self.refused.is_some() || self.terminal.is_some() {
            // R-JRN-4: nothing after the terminal.
            return;
        }
        if let Some(terminal) = terminal_of(&delivery) {
            self.terminal = Some((terminal, false));
            self.waiting.push_back((0, delivery));
            return;
        }
        if matches!(delivery, Delivery::Commit { .. }) {
            self.waiting.push_back((0, delivery));
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unwritten.push_back(JournalEvent {
            seq,
            payload: encode_entry(&delivery, source),
        });
        self.waiting.push_back((seq, delivery));
    }

    /// The next write for the store, when none is in flight.
    pub fn poll_write(&mut self) -> Option<JournalWrite> {
        if self.in_flight.is_some() || self.refused.is_some() {
            return None;
        }
        let held = self.spec.batch_until_terminal
            && self.terminal.is_none()
            && self.unwritten.len() < MAX_EVENTS_PER_APPEND
            && self
                .unwritten
                .iter()
                .map(|e| e.payload.len())
                .sum::<usize>()
                < MAX_BYTES_PER_APPEND;
        if !self.unwritten.is_empty() && !held {
            let mut events = Vec::new();
            let mut bytes = 0usize;
            while let Some(event) = self.unwritten.front() {
                if !events.is_empty()
                    && (events.len() >= MAX_EVENTS_PER_APPEND
                        || bytes + event.payload.len() > MAX_BYTES_PER_APPEND)
                {
                    break;
                }
                bytes += event.payload.len();
                events.extend(self.unwritten.pop_front());
            }
            let through = events.last().map_or(self.durable_seq, |e| e.seq);
            self.in_flight = Some(InFlight::Append(through));
            return Some(JournalWrite::Append {
                response_id: self.spec.response_id.clone(),
                epoch: self.spec.epoch,
                events,
            });
        }
        match &mut self.terminal {
            Some((_, false)) if self.terminal_delayed => None,
            Some((terminal, sent @ false)) => {
                *sent = true;
                self.terminal_writes += 1;
                self.in_flight = Some(InFlight::Finish);
                Some(JournalWrite::Finish {
                    response_id: self.spec.response_id.clone(),
                    epoch: self.spec.epoch,
                    terminal: terminal.clone(),
                })
            }
            _ => None,
        }
    }

    /// The store answered the write in flight.
    pub fn ack(&mut self, ack: JournalAck) {
        let Some(in_flight) = self.in_flight.take() else {
            return;
        };
        match (in_flight, ack) {
            (InFlight::Append(through), JournalAck::Appended) => self.durable_seq = through,
            (InFlight::Finish, JournalAck::Finished) => self.finished = true,
            (in_flight, JournalAck::Refused(e)) => {
                self.refused_terminal = in_flight == InFlight::Finish;
                self.refused = Some(e);
            }
            // An answer of the other kind is the driver's bug: treat it as
            // a failed store rather than publish what is not durable.
            (_, _) => self.refused = Some(JournalError::Store("mismatched answer".into())),
        }
        #[cfg(feature = "planted-bugs")]
        if self.finished
            && crate::planted::in_thread(crate::planted::PlantedBug::SecondJournalTerminal)
            && let Some((_, sent)) = &mut self.terminal
        {
            *sent = false;
        }
    }

    /// The next delivery that may reach the client: content once durable
    /// (R-JRN-1), the terminal once written, the head at once.
    pub fn poll_publish(&mut self) -> Option<Delivery> {
        if self.refused.is_some() {
            return None;
        }
        let (seq, delivery) = self.waiting.front()?;
        let ready = match delivery {
            Delivery::Commit { .. } => true,
            Delivery::Finish | Delivery::Fail { .. } => self.finished,
            _ => *seq <= self.durable_seq,
        };
        #[cfg(feature = "planted-bugs")]
        let ready = ready
            || (*seq > 0
                && crate::planted::in_thread(crate::planted::PlantedBug::PublishBeforeDurable));
        if !ready {
            return None;
        }
        self.waiting.pop_front().map(|(_, d)| d)
    }

    /// Drop everything not yet published (after a refusal the request ends
    /// outside the journal).
    pub fn discard(&mut self) {
        self.waiting.clear();
        self.unwritten.clear();
    }

    /// The store refused the write in flight (see [`Self::refused`]):
    /// decide how the record still gets its one terminal (R-JRN-4).
    /// `fallback` ends it when an append was refused; a terminal the store
    /// failed is written again later, at most [`MAX_TERMINAL_WRITES`]
    /// times in all. A fenced writer writes nothing more (R-JRN-3).
    pub fn after_refusal(&mut self, fallback: Terminal) -> AfterRefusal {
        let Some(error) = self.refused.clone() else {
            return AfterRefusal::GiveUp;
        };
        let may_still_end = matches!(error, JournalError::RecordTooLarge | JournalError::Store(_));
        if !may_still_end || self.terminal_writes >= MAX_TERMINAL_WRITES {
            return AfterRefusal::GiveUp;
        }
        if self.refused_terminal && matches!(error, JournalError::Store(_)) {
            // The same terminal again, once the store had a moment.
            self.refused = None;
            self.waiting
                .retain(|(seq, d)| *seq == 0 && terminal_of(d).is_some());
            self.unwritten.clear();
            if let Some((_, sent)) = &mut self.terminal {
                *sent = false;
            }
            self.terminal_delayed = true;
            return AfterRefusal::RetryTerminalLater;
        }
        self.finish_after_refusal(fallback);
        AfterRefusal::WriteFallback
    }

    /// Whether a refused terminal waits for [`Self::retry_terminal`].
    pub fn terminal_delayed(&self) -> bool {
        self.terminal_delayed
    }

    /// Write the delayed terminal now.
    pub fn retry_terminal(&mut self) {
        self.terminal_delayed = false;
    }

    /// Take over the terminal after a refusal that still lets the record
    /// end (a record grown past its bound, a failed store): the record gets
    /// this terminal instead of the refused remainder.
    pub fn finish_after_refusal(&mut self, terminal: Terminal) {
        if self.in_flight.is_some() || self.finished {
            return;
        }
        self.refused = None;
        self.waiting.clear();
        self.unwritten.clear();
        self.terminal = Some((terminal, false));
    }
}

/// How a run's journal write the store failed is tried again before the
/// response fails (R-JRN-6: a store outage degrades, never stops; R-JRN-1
/// still holds, since nothing is published until a write is durable):
/// a store's transient failure ([`JournalError::is_transient`]: a failed
/// commit, a queue full for the moment, a NATS server restarting, the
/// store reopening) is retried after a doubling delay, within
/// `max_attempts` attempts and `deadline` from the first. A rule's
/// refusal (fenced, out of order, too large) is never retried. While a
/// write waits, its run keeps reading its node stream up to
/// [`MAX_UNPUBLISHED`] deliveries, then pauses the provider (R-LIM-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteRetryPolicy {
    /// No retry starts later than this after the first attempt.
    pub deadline: Duration,
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    /// The delay before the first retry.
    pub first_delay: Duration,
    /// The delay's cap.
    pub max_delay: Duration,
}

/// The default [`WriteRetryPolicy`]: 10 s, 24 attempts, 50 ms doubling to
/// 1 s; a NATS server restart or an embedded store's reopen fits in it.
pub const WRITE_RETRY: WriteRetryPolicy = WriteRetryPolicy {
    deadline: Duration::from_secs(10),
    max_attempts: 24,
    first_delay: Duration::from_millis(50),
    max_delay: Duration::from_secs(1),
};

/// What to do after a store's answer to an attempt of a [`JournalWrite`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteVerdict {
    /// Try the same write again at this moment.
    RetryAt(Instant),
    /// This is the request's answer.
    Answer(JournalAck),
}

/// The attempts of one [`JournalWrite`] (see [`WriteRetryPolicy`]).
#[derive(Debug, Clone)]
pub struct WriteRetry {
    policy: WriteRetryPolicy,
    started: Instant,
    attempts: u32,
}

impl WriteRetry {
    /// The first attempt starts at `now`.
    pub fn new(policy: WriteRetryPolicy, now: Instant) -> Self {
        WriteRetry {
            policy,
            started: now,
            attempts: 1,
        }
    }

    /// Attempts made so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The store answered the latest attempt of `write` with `result` at
    /// `now`. A retry that finds its write already there (an earlier
    /// attempt's commit did land though its answer was a failure: the
    /// record's next number is past the append's events, or the terminal
    /// is in, under this writer's own epoch) is that write's success.
    pub fn answered(
        &mut self,
        now: Instant,
        write: &JournalWrite,
        result: Result<(), JournalError>,
    ) -> WriteVerdict {
        let success = match write {
            JournalWrite::Append { .. } => JournalAck::Appended,
            JournalWrite::Finish { .. } => JournalAck::Finished,
        };
        let error = match result {
            Ok(()) => return WriteVerdict::Answer(success),
            Err(e) => e,
        };
        if self.attempts > 1 && landed(write, &error) {
            return WriteVerdict::Answer(success);
        }
        if !error.is_transient() || self.attempts >= self.policy.max_attempts {
            return WriteVerdict::Answer(JournalAck::Refused(error));
        }
        let factor = 1u32
            .checked_shl((self.attempts - 1).min(31))
            .unwrap_or(u32::MAX);
        let delay = self
            .policy
            .first_delay
            .checked_mul(factor)
            .unwrap_or(self.policy.max_delay)
            .min(self.policy.max_delay);
        let at = now.saturating_add(delay);
        if at > self.started.saturating_add(self.policy.deadline) {
            return WriteVerdict::Answer(JournalAck::Refused(error));
        }
        self.attempts += 1;
        WriteVerdict::RetryAt(at)
    }
}

/// Whether `error`, answered to a retry of `write`, says an earlier
/// attempt of it is durable: the append's events are the record's last
/// ones, or the record has its terminal under the writer's epoch (a
/// terminal under another epoch is refused as fenced first).
fn landed(write: &JournalWrite, error: &JournalError) -> bool {
    match (write, error) {
        (JournalWrite::Append { events, .. }, JournalError::OutOfOrder { expected, got }) => {
            match (events.first(), events.last()) {
                (Some(first), Some(last)) => *got == first.seq && *expected == last.seq + 1,
                _ => false,
            }
        }
        (JournalWrite::Finish { .. }, JournalError::Terminated) => true,
        _ => false,
    }
}

mod legacy;

#[cfg(test)]
mod tests {
    use iop_wire::{FinishReason, RunEventKind, Usage};

    use super::*;

    fn spec() -> JournalSpec {
        JournalSpec {
            response_id: "resp_1".into(),
            epoch: 1,
            batch_until_terminal: false,
        }
    }

    fn text(s: &str) -> Delivery {
        Delivery::Event(RunEventKind::TextDelta(s.into()))
    }

    fn drain(p: &mut Publisher) -> Vec<Delivery> {
        std::iter::from_fn(|| p.poll_publish()).collect()
    }

    #[test]
    fn r_jrn_1_content_is_published_only_after_its_append_is_durable() {
        let mut p = Publisher::new(spec(), 0);
        p.push(Delivery::Commit { tunnel_head: None });
        p.push(text("a"));
        assert_eq!(drain(&mut p), vec![Delivery::Commit { tunnel_head: None }]);
        let Some(JournalWrite::Append { events, epoch, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!((events[0].seq, epoch), (1, 1));
        assert_eq!(decode_delivery(&events[0].payload), Some(text("a")));
        assert!(drain(&mut p).is_empty(), "not durable yet");
        p.ack(JournalAck::Appended);
        assert_eq!(drain(&mut p), vec![text("a")]);
    }

    #[test]
    fn r_jrn_1_deliveries_during_a_sync_share_the_next_append() {
        let mut p = Publisher::new(spec(), 0);
        p.push(text("a"));
        assert!(p.poll_write().is_some());
        for s in ["b", "c", "d"] {
            p.push(text(s));
            assert!(p.poll_write().is_none(), "one write in flight");
        }
        p.ack(JournalAck::Appended);
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![2, 3, 4],
            "R-JRN-2: numbered without gap"
        );
    }

    #[test]
    fn r_jrn_4_the_terminal_is_written_after_every_event_and_published_last() {
        let mut p = Publisher::new(spec(), 0);
        p.push(text("a"));
        p.push(Delivery::Finish);
        p.push(text("late"));
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(events.len(), 1, "nothing after the terminal");
        p.ack(JournalAck::Appended);
        assert_eq!(drain(&mut p), vec![text("a")]);
        let Some(JournalWrite::Finish { terminal, .. }) = p.poll_write() else {
            panic!("the terminal");
        };
        assert_eq!(terminal.status, RecordStatus::Completed);
        assert!(!p.is_idle());
        p.ack(JournalAck::Finished);
        assert_eq!(drain(&mut p), vec![Delivery::Finish]);
        assert!(p.is_idle());
        assert!(p.poll_write().is_none());
    }

    #[test]
    fn a_refused_write_publishes_nothing_more() {
        let mut p = Publisher::new(spec(), 0);
        p.push(text("a"));
        let _ = p.poll_write();
        p.ack(JournalAck::Refused(JournalError::Fenced {
            current: 2,
            writer: 1,
        }));
        assert!(drain(&mut p).is_empty());
        p.push(text("b"));
        assert!(p.poll_write().is_none());
        assert!(p.is_idle());
    }

    #[test]
    fn a_resumed_writer_numbers_from_the_durable_prefix() {
        let mut p = Publisher::new(spec(), 7);
        p.push(text("a"));
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(events[0].seq, 8);
    }

    #[test]
    fn a_whole_answer_is_written_with_its_last_events_in_one_append() {
        let mut p = Publisher::new(
            JournalSpec {
                batch_until_terminal: true,
                ..spec()
            },
            0,
        );
        p.push(text("a"));
        p.push(text("b"));
        assert!(p.poll_write().is_none(), "held until the terminal");
        p.push(Delivery::Finish);
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(events.len(), 2, "both events in one append");
        p.ack(JournalAck::Appended);
        assert!(matches!(p.poll_write(), Some(JournalWrite::Finish { .. })));
        // A large answer is still written as it grows.
        let mut p = Publisher::new(
            JournalSpec {
                batch_until_terminal: true,
                ..spec()
            },
            0,
        );
        let big = "x".repeat(MAX_BYTES_PER_APPEND);
        p.push(text(&big));
        assert!(
            p.poll_write().is_some(),
            "past the byte bound it is written"
        );
    }

    #[test]
    fn appends_are_bounded_in_events() {
        let mut p = Publisher::new(spec(), 0);
        for _ in 0..MAX_EVENTS_PER_APPEND + 3 {
            p.push(text("x"));
        }
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(events.len(), MAX_EVENTS_PER_APPEND);
    }

    #[test]
    fn a_delivery_encodes_and_decodes_as_itself_without_a_frame() {
        for d in [
            text("a"),
            Delivery::Finish,
            Delivery::Body(vec![0, 1, 2]),
            Delivery::Commit { tunnel_head: None },
        ] {
            let payload = encode_delivery(&d);
            assert_eq!(payload[0], ENTRY_FORMAT);
            assert_eq!(
                decode_entry(&payload),
                Some(JournalEntry {
                    delivery: d.clone(),
                    source: None
                })
            );
            assert_eq!(decode_delivery(&payload), Some(d));
        }
        assert_eq!(decode_delivery(&[]), None);
        assert_eq!(decode_delivery(&[ENTRY_FORMAT + 1, 0]), None);
    }

    #[test]
    fn entries_an_earlier_build_wrote_still_decode_without_cache_counts() {
        // Format 1, as the build before the prompt cache's counts wrote
        // them (bytes from that build): an adopting or replaying Edge of
        // this build reads them as they were.
        let source = |frame| {
            Some(FrameSource {
                key: RunKey {
                    generation: 3,
                    run_id: 9,
                },
                frame,
                provider_id: ProviderId::from("p1"),
            })
        };
        let cases: [(&[u8], JournalEntry); 6] = [
            (
                &[1, 1, 3, 12, 1, 1, 3, 9, 2, 2, 112, 49],
                JournalEntry {
                    delivery: Delivery::Event(RunEventKind::Usage(Usage::tokens(12, 1))),
                    source: source(2),
                },
            ),
            (
                &[1, 1, 4, 1, 1, 172, 2, 240, 162, 4, 1, 3, 9, 4, 2, 112, 49],
                JournalEntry {
                    delivery: Delivery::Event(RunEventKind::Completed {
                        finish_reason: FinishReason::Length,
                        usage: Some(Usage::tokens(300, 70_000)),
                    }),
                    source: source(4),
                },
            ),
            (
                &[1, 1, 1, 6, 104, 195, 169, 108, 108, 111, 0],
                JournalEntry {
                    delivery: Delivery::Event(RunEventKind::TextDelta("héllo".into())),
                    source: None,
                },
            ),
            (
                &[1, 0, 0, 0],
                JournalEntry {
                    delivery: Delivery::Commit { tunnel_head: None },
                    source: None,
                },
            ),
            (
                &[
                    1, 4, 1, 1, 1, 1, 1, 173, 3, 1, 9, 115, 108, 111, 119, 32, 100, 111, 119, 110,
                    0,
                ],
                JournalEntry {
                    delivery: Delivery::Fail {
                        kind: GateFailure::Attempt(FailureCode::ProviderError),
                        in_stream: true,
                        provider: Some(ProviderSaid {
                            http_status: Some(429),
                            message: Some("slow down".into()),
                        }),
                    },
                    source: None,
                },
            ),
            (
                &[1, 3, 0],
                JournalEntry {
                    delivery: Delivery::Finish,
                    source: None,
                },
            ),
        ];
        for (payload, entry) in cases {
            assert_eq!(decode_entry(payload).as_ref(), Some(&entry), "{payload:?}");
            // Written again, it is this build's format, and reads the same.
            let again = encode_entry(&entry.delivery, entry.source.clone());
            assert_eq!(again[0], ENTRY_FORMAT);
            assert_ne!(&again[..], payload);
            assert_eq!(decode_entry(&again), Some(entry));
        }
        // Format 1 bytes of another shape are refused, not misread.
        assert_eq!(decode_entry(&[1, 1, 3, 12]), None);
    }

    #[test]
    fn the_prompt_caches_counts_survive_the_journal() {
        for usage in [
            Usage::tokens(12, 1),
            Usage {
                cache_read_tokens: Some(8),
                ..Usage::tokens(12, 1)
            },
            Usage {
                cache_read_tokens: Some(0),
                cache_write_tokens: Some(12),
                ..Usage::tokens(12, 1)
            },
        ] {
            for d in [
                Delivery::Event(RunEventKind::Usage(usage)),
                Delivery::Event(RunEventKind::Completed {
                    finish_reason: FinishReason::Stop,
                    usage: Some(usage),
                }),
            ] {
                assert_eq!(decode_delivery(&encode_delivery(&d)), Some(d));
            }
        }
    }

    #[test]
    fn idle_means_nothing_waiting_in_flight_or_unwritten() {
        let mut p = Publisher::new(spec(), 0);
        assert!(p.is_idle(), "new");
        p.push(text("a"));
        assert!(!p.is_idle(), "waiting and unwritten");
        let _ = p.poll_write();
        assert!(!p.is_idle(), "in flight");
        p.ack(JournalAck::Appended);
        assert_eq!(p.backlog(), 1);
        assert!(!p.is_idle(), "durable but not yet published");
        assert_eq!(drain(&mut p), vec![text("a")]);
        assert!(p.is_idle(), "published");
    }

    /// A text delivery whose journal payload is exactly `bytes` long.
    fn text_of_payload(bytes: usize) -> Delivery {
        let start = bytes.saturating_sub(16);
        (start..start + 16)
            .map(|n| text(&"x".repeat(n)))
            .find(|d| encode_delivery(d).len() == bytes)
            .unwrap_or_else(|| panic!("no text encodes to {bytes} bytes"))
    }

    #[test]
    fn appends_are_bounded_in_bytes_and_take_exactly_the_bound() {
        let half = text_of_payload(MAX_BYTES_PER_APPEND / 2);
        let mut p = Publisher::new(spec(), 0);
        for _ in 0..3 {
            p.push(half.clone());
        }
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2],
            "two halves fill the bound exactly; the third waits"
        );
        p.ack(JournalAck::Appended);
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(events.len(), 1);
        // One event larger than the bound still goes out, alone.
        let mut p = Publisher::new(spec(), 0);
        p.push(text_of_payload(MAX_BYTES_PER_APPEND + 1));
        p.push(text("y"));
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("an append");
        };
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn a_batched_answer_is_written_once_it_reaches_either_bound() {
        let batched = || {
            Publisher::new(
                JournalSpec {
                    batch_until_terminal: true,
                    ..spec()
                },
                0,
            )
        };
        // Events: one short of the bound is held, the bound is written.
        let mut p = batched();
        for _ in 0..MAX_EVENTS_PER_APPEND - 1 {
            p.push(text("x"));
        }
        assert!(p.poll_write().is_none());
        p.push(text("x"));
        let Some(JournalWrite::Append { events, .. }) = p.poll_write() else {
            panic!("written at the event bound");
        };
        assert_eq!(events.len(), MAX_EVENTS_PER_APPEND);
        // Bytes: likewise.
        let mut p = batched();
        p.push(text_of_payload(MAX_BYTES_PER_APPEND - 1));
        assert!(p.poll_write().is_none());
        let mut p = batched();
        p.push(text_of_payload(MAX_BYTES_PER_APPEND));
        assert!(p.poll_write().is_some(), "written at the byte bound");
    }

    #[test]
    fn the_terminal_and_the_last_number_are_reported() {
        let mut p = Publisher::new(spec(), 7);
        assert_eq!(p.last_assigned(), 7);
        assert!(!p.has_terminal());
        p.push(Delivery::Commit { tunnel_head: None });
        assert_eq!(p.last_assigned(), 7, "the head is no journal event");
        p.push(text("a"));
        p.push(text("b"));
        assert_eq!(p.last_assigned(), 9);
        p.push(Delivery::Finish);
        assert!(p.has_terminal());
        assert_eq!(p.last_assigned(), 9);
    }

    #[test]
    fn a_refused_terminal_keeps_only_itself_and_waits_for_its_retry_r_jrn_4() {
        let mut p = Publisher::new(spec(), 0);
        p.push(Delivery::Commit { tunnel_head: None });
        p.push(text("a"));
        p.push(Delivery::Finish);
        let _ = p.poll_write();
        p.ack(JournalAck::Appended);
        assert!(matches!(p.poll_write(), Some(JournalWrite::Finish { .. })));
        p.ack(JournalAck::Refused(JournalError::Store("disk".into())));
        assert!(!p.terminal_delayed());
        assert_eq!(
            p.after_refusal(Terminal {
                status: RecordStatus::Failed,
                reason: None,
                message: None,
                at_unix_ms: 0,
            }),
            AfterRefusal::RetryTerminalLater
        );
        assert!(p.terminal_delayed());
        assert_eq!(p.backlog(), 1, "only the terminal waits");
        assert!(p.poll_write().is_none(), "not before its retry");
        p.retry_terminal();
        assert!(!p.terminal_delayed());
        let Some(JournalWrite::Finish { terminal, .. }) = p.poll_write() else {
            panic!("the same terminal again");
        };
        assert_eq!(terminal.status, RecordStatus::Completed);
        p.ack(JournalAck::Finished);
        assert_eq!(drain(&mut p), vec![Delivery::Finish]);
    }

    #[test]
    fn discard_drops_everything_unpublished() {
        let mut p = Publisher::new(spec(), 0);
        p.push(text("a"));
        p.push(text("b"));
        p.discard();
        assert_eq!(p.backlog(), 0);
        assert!(p.poll_write().is_none(), "nothing unwritten");
        assert!(p.is_idle());
    }

    #[test]
    fn a_fallback_terminal_never_replaces_a_write_in_flight_or_a_durable_terminal() {
        let fallback = Terminal {
            status: RecordStatus::Failed,
            reason: Some("journal_unavailable".into()),
            message: None,
            at_unix_ms: 0,
        };
        let mut p = Publisher::new(spec(), 0);
        p.push(text("a"));
        let _ = p.poll_write();
        p.finish_after_refusal(fallback.clone());
        assert!(!p.has_terminal(), "a write is in flight");
        p.ack(JournalAck::Appended);
        assert_eq!(drain(&mut p), vec![text("a")]);
        // After the record's terminal is durable, nothing replaces it.
        p.push(Delivery::Finish);
        let _ = p.poll_write();
        p.ack(JournalAck::Finished);
        p.finish_after_refusal(fallback);
        assert_eq!(drain(&mut p), vec![Delivery::Finish]);
        assert!(p.poll_write().is_none());
    }

    #[test]
    fn terminals_map_to_record_statuses() {
        let status = |d: Delivery| terminal_of(&d).map(|t| t.status);
        assert_eq!(status(Delivery::Finish), Some(RecordStatus::Completed));
        assert_eq!(
            status(Delivery::Fail {
                kind: GateFailure::Attempt(FailureCode::Canceled),
                in_stream: true,
                provider: None,
            }),
            Some(RecordStatus::Cancelled)
        );
        assert_eq!(
            status(Delivery::Fail {
                kind: GateFailure::BudgetExpired,
                in_stream: true,
                provider: None,
            }),
            Some(RecordStatus::Failed)
        );
        assert_eq!(status(text("a")), None);
    }

    fn record(last_seq: u64) -> crate::journal::RecordMeta {
        crate::journal::RecordMeta {
            id: "resp_1".into(),
            principal: "p".into(),
            api: crate::journal::JournalApi::ChatCompletions,
            model: "m".into(),
            fingerprint: [0; 32],
            idempotency_key: None,
            background: false,
            created_unix_ms: 0,
            epoch: 1,
            last_seq,
            terminal: None,
            expires_unix_ms: u64::MAX,
            stored_bytes: 0,
            owner: "edge-a".into(),
            key_id: "k".into(),
        }
    }

    fn parked(key: RunKey, provider: &str) -> crate::edge::dispatch::ParkedOffer {
        crate::edge::dispatch::ParkedOffer {
            run: iop_wire::ParkedRun {
                key,
                response_id: "resp_1".into(),
                adapter: iop_wire::AdapterKind::Mock,
                target: "m".into(),
                first_kept_frame: 1,
                last_frame: 9,
                ended: false,
            },
            provider_id: ProviderId::from(provider),
            node: crate::ids::NodeId::from("n"),
        }
    }

    #[cfg(feature = "planted-bugs")]
    #[test]
    fn planted_refuse_unjournaled_park_refuses_a_record_that_holds_nothing_r_park_2() {
        use crate::planted::{PlantedBug, clear_thread, plant_in_thread};
        let key = RunKey {
            generation: 7,
            run_id: 3,
        };
        plant_in_thread(PlantedBug::RefuseUnjournaledPark);
        let refused = takeover_resume_point(&record(0), None, &parked(key, "p0"));
        clear_thread();
        assert_eq!(refused, Err(TakeoverRefusal::NoFrameSource));
        assert_eq!(
            takeover_resume_point(&record(0), None, &parked(key, "p0")),
            Ok(0)
        );
    }

    #[test]
    fn a_takeover_resumes_after_the_last_journaled_frame_of_the_reported_run_only_r_park_2_r_take_1()
     {
        let key = RunKey {
            generation: 7,
            run_id: 3,
        };
        let from = |key: RunKey, provider: &str, frame: u64| {
            encode_entry(
                &text("a"),
                Some(FrameSource {
                    key,
                    frame,
                    provider_id: ProviderId::from(provider),
                }),
            )
        };
        let offer = parked(key, "p0");
        let last = from(key, "p0", 5);
        assert_eq!(
            takeover_resume_point(&record(4), Some(&last), &offer),
            Ok(5),
            "the frame of the record's last event"
        );
        let mut ended = record(4);
        ended.terminal = terminal_of(&Delivery::Finish);
        assert_eq!(
            takeover_resume_point(&ended, Some(&last), &offer),
            Err(TakeoverRefusal::Ended)
        );
        assert_eq!(
            takeover_resume_point(&record(0), None, &offer),
            Ok(0),
            "nothing journaled: from the run's first frame"
        );
        assert_eq!(
            takeover_resume_point(&record(4), Some(&encode_delivery(&text("a"))), &offer),
            Err(TakeoverRefusal::NoFrameSource),
            "an event with no node frame"
        );
        assert_eq!(
            takeover_resume_point(&record(4), Some(b"\xffunknown"), &offer),
            Err(TakeoverRefusal::NoFrameSource),
            "bytes this build does not read"
        );
        assert_eq!(
            takeover_resume_point(&record(4), None, &offer),
            Err(TakeoverRefusal::NoFrameSource),
            "the last event could not be read"
        );
        let other_run = RunKey { run_id: 4, ..key };
        assert_eq!(
            takeover_resume_point(&record(4), Some(&from(other_run, "p0", 5)), &offer),
            Err(TakeoverRefusal::AnotherRun),
            "a report cannot name another run's record into its run"
        );
        assert_eq!(
            takeover_resume_point(&record(4), Some(&last), &parked(key, "p1")),
            Err(TakeoverRefusal::AnotherRun),
            "only the provider that ran it"
        );
    }

    #[test]
    fn a_failed_records_terminal_keeps_what_the_provider_said_r_gate_3() {
        let fail = |status: Option<u16>| Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::ProviderError),
            in_stream: false,
            provider: Some(ProviderSaid {
                http_status: status,
                message: Some("Input should be 'text' or 'json_object'".into()),
            }),
        };
        for (status, reason) in [
            (Some(400), "provider_error_http_400"),
            (Some(422), "provider_error_http_422"),
            (Some(429), "provider_error_http_429"),
            (Some(500), "provider_error_http_500"),
            (None, "provider_error"),
        ] {
            let terminal = terminal_of(&fail(status)).expect("a terminal");
            assert_eq!(terminal.status, RecordStatus::Failed);
            assert_eq!(terminal.reason.as_deref(), Some(reason), "{status:?}");
            let (kind, said) = failure_of(&terminal).expect("a known reason");
            assert_eq!(kind, GateFailure::Attempt(FailureCode::ProviderError));
            let said = said.expect("what the provider said");
            assert_eq!(said.http_status, status);
            assert_eq!(
                said.message.as_deref(),
                Some("Input should be 'text' or 'json_object'")
            );
        }
        // Nothing said: the failure alone, as before.
        let plain = terminal_of(&Delivery::Fail {
            kind: GateFailure::BudgetExpired,
            in_stream: true,
            provider: None,
        })
        .unwrap();
        assert_eq!(failure_of(&plain), Some((GateFailure::BudgetExpired, None)));
    }

    #[test]
    fn a_journal_answer_is_an_http_error_only_if_it_failed_before_any_event_r_gate_3() {
        let failed = terminal_of(&Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::ProviderError),
            in_stream: false,
            provider: None,
        })
        .expect("a terminal");
        let completed = terminal_of(&Delivery::Finish).expect("a terminal");
        assert!(ended_before_commit(&failed, 0));
        assert!(!ended_before_commit(&failed, 1), "committed: in the stream");
        assert!(!ended_before_commit(&completed, 0), "an empty answer");
        let mut cancelled = failed.clone();
        cancelled.status = RecordStatus::Cancelled;
        assert!(ended_before_commit(&cancelled, 0));
    }

    /// R-TEN-2: an answer's journal is charged by all the output it
    /// holds after its last usage report: text, reasoning and tool calls.
    #[test]
    fn r_ten_2_journaled_use_counts_reasoning_and_tool_calls_after_the_last_report() {
        let journal = |deliveries: Vec<Delivery>| -> Vec<JournalEvent> {
            deliveries
                .iter()
                .enumerate()
                .map(|(i, d)| JournalEvent {
                    seq: i as u64 + 1,
                    payload: encode_entry(d, None),
                })
                .collect()
        };
        let call = Delivery::Event(RunEventKind::ToolCallDelta(iop_wire::ToolCallDelta {
            index: 0,
            id: Some("c".into()),
            name: Some("get".into()),
            arguments_delta: "{\"a\":1}".into(),
        }));
        let reasoning = Delivery::Event(RunEventKind::ReasoningDelta("thinking".into()));
        // 5 + 8 + 3 + 7 characters: 23, 6 tokens.
        let events = journal(vec![text("Hello"), reasoning.clone(), call.clone()]);
        assert_eq!(
            journaled_use(&events),
            JournaledUse {
                usage: None,
                text_tokens: 6
            }
        );
        // A report covers what came before it.
        let report = Delivery::Event(RunEventKind::Usage(Usage::tokens(9, 4)));
        let events = journal(vec![text("Hello"), reasoning, report, call]);
        assert_eq!(
            journaled_use(&events),
            JournaledUse {
                usage: Some(Usage::tokens(9, 4)),
                text_tokens: 3
            }
        );
    }

    fn append_of(seqs: std::ops::RangeInclusive<u64>) -> JournalWrite {
        JournalWrite::Append {
            response_id: "resp_1".into(),
            epoch: 1,
            events: seqs
                .map(|seq| JournalEvent {
                    seq,
                    payload: vec![1],
                })
                .collect(),
        }
    }

    fn finish_write() -> JournalWrite {
        JournalWrite::Finish {
            response_id: "resp_1".into(),
            epoch: 1,
            terminal: terminal_of(&Delivery::Finish).unwrap(),
        }
    }

    fn store_failed() -> Result<(), JournalError> {
        Err(JournalError::Store(
            "the journal's write queue is full".into(),
        ))
    }

    #[test]
    fn r_jrn_6_a_transient_store_failure_is_retried_until_it_succeeds() {
        let t0 = Instant::from_millis(1_000);
        let write = append_of(3..=4);
        let mut retry = WriteRetry::new(WRITE_RETRY, t0);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..4 {
            match retry.answered(now, &write, store_failed()) {
                WriteVerdict::RetryAt(at) => {
                    delays.push(at - now);
                    now = at;
                }
                other => panic!("expected a retry, got {other:?}"),
            }
        }
        assert_eq!(
            delays,
            [50, 100, 200, 400].map(Duration::from_millis).to_vec(),
            "doubling from 50 ms"
        );
        // The store reopening (R-JRN-6) is as transient.
        let unavailable = Err(JournalError::Unavailable(
            crate::journal::availability::StoreState::Reopening,
        ));
        assert!(matches!(
            retry.answered(now, &write, unavailable),
            WriteVerdict::RetryAt(_)
        ));
        assert_eq!(
            retry.answered(now, &write, Ok(())),
            WriteVerdict::Answer(JournalAck::Appended)
        );
        assert_eq!(retry.attempts(), 6);
    }

    #[test]
    fn r_jrn_6_retries_stop_at_the_deadline_and_at_the_attempt_bound() {
        let t0 = Instant::ZERO;
        let write = append_of(1..=1);
        let mut retry = WriteRetry::new(WRITE_RETRY, t0);
        let mut now = t0;
        let last = loop {
            match retry.answered(now, &write, store_failed()) {
                WriteVerdict::RetryAt(at) => {
                    assert!(
                        at - t0 <= WRITE_RETRY.deadline,
                        "no retry past the deadline"
                    );
                    assert!(at - now <= WRITE_RETRY.max_delay);
                    now = at;
                }
                WriteVerdict::Answer(ack) => break ack,
            }
        };
        assert!(matches!(last, JournalAck::Refused(JournalError::Store(_))));
        assert!(now - t0 > WRITE_RETRY.deadline - WRITE_RETRY.max_delay);
        // A tight attempt bound ends it sooner.
        let policy = WriteRetryPolicy {
            max_attempts: 3,
            ..WRITE_RETRY
        };
        let mut retry = WriteRetry::new(policy, t0);
        assert!(matches!(
            retry.answered(t0, &write, store_failed()),
            WriteVerdict::RetryAt(_)
        ));
        assert!(matches!(
            retry.answered(t0, &write, store_failed()),
            WriteVerdict::RetryAt(_)
        ));
        assert!(matches!(
            retry.answered(t0, &write, store_failed()),
            WriteVerdict::Answer(JournalAck::Refused(_))
        ));
    }

    #[test]
    fn a_rules_refusal_is_never_retried() {
        for refusal in [
            JournalError::Fenced {
                current: 2,
                writer: 1,
            },
            JournalError::RecordTooLarge,
            JournalError::Full,
            JournalError::NotFound,
            JournalError::Terminated,
            JournalError::OutOfOrder {
                expected: 5,
                got: 3,
            },
        ] {
            let mut retry = WriteRetry::new(WRITE_RETRY, Instant::ZERO);
            assert_eq!(
                retry.answered(Instant::ZERO, &append_of(3..=4), Err(refusal.clone())),
                WriteVerdict::Answer(JournalAck::Refused(refusal))
            );
        }
    }

    #[test]
    fn r_jrn_6_a_retry_that_finds_its_write_durable_is_its_success() {
        // The first attempt's commit landed though the store answered a
        // failure; the retry is refused as out of order, one past its
        // events: that is the append, durable.
        let write = append_of(3..=4);
        let mut retry = WriteRetry::new(WRITE_RETRY, Instant::ZERO);
        let WriteVerdict::RetryAt(at) = retry.answered(Instant::ZERO, &write, store_failed())
        else {
            panic!("a retry");
        };
        let landed = Err(JournalError::OutOfOrder {
            expected: 5,
            got: 3,
        });
        assert_eq!(
            retry.answered(at, &write, landed),
            WriteVerdict::Answer(JournalAck::Appended)
        );
        // Out of order otherwise is a refusal, retried or not.
        let mut retry = WriteRetry::new(WRITE_RETRY, Instant::ZERO);
        let WriteVerdict::RetryAt(at) = retry.answered(Instant::ZERO, &write, store_failed())
        else {
            panic!("a retry");
        };
        let other = Err(JournalError::OutOfOrder {
            expected: 7,
            got: 3,
        });
        assert!(matches!(
            retry.answered(at, &write, other),
            WriteVerdict::Answer(JournalAck::Refused(_))
        ));
        // A terminal found in place under this writer's epoch is its own.
        let mut retry = WriteRetry::new(WRITE_RETRY, Instant::ZERO);
        let finish = finish_write();
        let WriteVerdict::RetryAt(at) = retry.answered(Instant::ZERO, &finish, store_failed())
        else {
            panic!("a retry");
        };
        assert_eq!(
            retry.answered(at, &finish, Err(JournalError::Terminated)),
            WriteVerdict::Answer(JournalAck::Finished)
        );
    }
}
