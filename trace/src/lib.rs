//! The trace format: a versioned JSON-lines record of one core state
//! machine's inputs and outputs, and its replay.
//!
//! ## Format (version 3)
//!
//! A trace is UTF-8 text, one JSON object per line.
//!
//! * Line 1, the header:
//!   `{"format":"iop-trace","version":3,"machine":"edge-dispatch","config":{...}}`.
//!   `machine` is one of [`MachineKind`]'s names (`edge-dispatch`,
//!   `edge-link`, `node-link`, `edge-request`, `node-run`, `edge-custody`,
//!   `edge-tenants`, `heartbeat`, `store-availability`); `config` is
//!   everything needed to build a fresh machine (its `*ConfigRec`:
//!   [`DispatchConfigRec`], [`EdgeLinkConfigRec`], [`NodeLinkConfigRec`],
//!   [`RequestConfigRec`], [`NodeRunConfigRec`], [`CustodyConfigRec`],
//!   [`TenantsConfigRec`], [`HeartbeatConfigRec`],
//!   [`AvailabilityConfigRec`]).
//! * Every later line is one of
//!   * `{"in":INPUT,"t":T}`: the driver fed `INPUT` at `T` microseconds
//!     ([`iop_core::Instant::as_micros`]);
//!   * `{"out":OUTPUT,"t":T}`: the driver drained `OUTPUT` with
//!     `poll_output()` at `T`;
//!   * `{"ask":QUERY,"t":T}` then `{"answer":ANSWER,"t":T}`: the driver
//!     asked a question the machine answers directly
//!     ([`iop_core::Answers`]: the node connection's run start, offer and
//!     observation number), and the call returned `ANSWER`.
//!
//!   Key order is not significant (the writer sorts keys); blank lines are
//!   ignored; a line may be at most [`MAX_TRACE_LINE_BYTES`] long.
//!
//! Outputs are recorded *when the driver drains them*, not when the machine
//! queues them, so a replay drains at exactly the same points and the two
//! sequences compare line by line; a replay asks every recorded question
//! again and compares its answer the same way. `poll_timeout()` is not recorded: a timer
//! firing appears as the `handle_timeout` input.
//!
//! A [`Machine`]'s inputs and outputs are the core enums themselves: each
//! input inside a [`Step`] (the dispatcher's [`DispatchInput`], the node
//! connection's `NodeLinkInput`, the request's `RequestInput`, ...), each
//! output as it is (`DispatchOutput`, `NodeLinkOutput`, `RequestOutput`,
//! ...). All are externally tagged in `snake_case`; wire types
//! (`iop_wire`) appear as they serialize themselves.
//!
//! ## Driving and recording
//!
//! Every shell task and the simulator hold each machine in a [`Driven`]
//! (the one driver helper: feed, drain, fire the timer) with a [`Tap`]
//! over a [`TraceWriter`] (see [`TraceFiles`] for the shells' files). It
//! exposes the core API unchanged (core types in, core types out) and
//! writes a line per call; with [`Tap::off`] it costs nothing.
//!
//! ## Replay
//!
//! [`replay`] reads a trace with [`TraceReader`], builds a fresh machine from
//! the header, feeds every `in` line, and checks every `out` line
//! against what the fresh machine produces. The first difference is reported
//! as a [`Divergence`] with its line number. Every kind replays except
//! `edge-tenants` ([`ReplayError::NotReplayable`]: its admissions and
//! settlements are direct answers, not inputs).

use std::io::{BufRead, Write};

mod files;

pub use files::TraceFiles;

use iop_core::edge::custody::{Custody, CustodyConfig};
use iop_core::edge::dispatch::{DispatchConfig, DispatchInput, Dispatcher, ParkedOffer};
use iop_core::edge::durable::ResumedAnswer;
use iop_core::edge::link::{EdgeLink, EdgeLinkConfig};
use iop_core::edge::request::{Request, RequestSpec};
use iop_core::journal::availability::Availability;
use iop_core::liveness::heartbeat::{Heartbeat, HeartbeatConfig};
use iop_core::node::link::{NodeLink, NodeLinkConfig};
use iop_core::node::link::{NodeLinkAnswer, NodeLinkQuery, RunStart};
use iop_core::node::run::{NodeRun, RunFrame, RunSpec};
use iop_core::node::watchdog::RunKind;
use iop_core::node::watchdog::{Emission, ProviderEvent};
use iop_core::tenant::TenantsConfig;
use iop_core::{Answers, Instant, Machine};
use iop_wire::{FailureCode, ProviderTunnelFrame, RegisterRequest, RunEventKind};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The `format` value of every trace header.
pub const TRACE_FORMAT: &str = "iop-trace";

/// The trace format version this crate writes and reads.
///
/// Version 2 records every machine's own config, input and output types
/// (`{"config":{...},"created_us":T}` headers, `{"in":{"input":...}}` and
/// `{"in":"handle_timeout"}` lines); version 1's mirror types are gone.
/// Version 3 adds the `ask` and `answer` lines of questions a machine
/// answers directly (a node connection's run start, offer and observation
/// number were inputs answered by outputs in version 2).
pub const TRACE_VERSION: u32 = 3;

/// The longest trace line [`TraceReader`] accepts, in bytes (bounded input).
pub const MAX_TRACE_LINE_BYTES: usize = 1 << 20;

/// Which core machine a trace records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MachineKind {
    /// [`iop_core::edge::dispatch::Dispatcher`].
    #[serde(rename = "edge-dispatch")]
    EdgeDispatch,
    /// [`iop_core::edge::link::EdgeLink`]: one node connection at the Edge.
    #[serde(rename = "edge-link")]
    EdgeLink,
    /// [`iop_core::node::link::NodeLink`]: one Node connection.
    #[serde(rename = "node-link")]
    NodeLink,
    /// [`iop_core::edge::request::Request`]: one client request at the Edge.
    #[serde(rename = "edge-request")]
    EdgeRequest,
    /// [`iop_core::node::run::NodeRun`]: one run on the node.
    #[serde(rename = "node-run")]
    NodeRun,
    /// [`iop_core::edge::custody::Custody`]: an Edge's takeovers and
    /// adoptions.
    #[serde(rename = "edge-custody")]
    EdgeCustody,
    /// [`iop_core::tenant::Tenants`]: an Edge's tenants' limits and usage.
    #[serde(rename = "edge-tenants")]
    EdgeTenants,
    /// [`iop_core::liveness::heartbeat::Heartbeat`] on its own (in a
    /// process it lives inside each `EdgeLink` and `NodeLink`, whose traces
    /// carry its pings, pongs and timeouts).
    #[serde(rename = "heartbeat")]
    Heartbeat,
    /// [`iop_core::journal::availability::Availability`]: whether an
    /// Edge's journal store is up, and when to open it again.
    #[serde(rename = "store-availability")]
    StoreAvailability,
}

impl MachineKind {
    /// Every kind.
    pub const ALL: [MachineKind; 9] = [
        MachineKind::EdgeDispatch,
        MachineKind::EdgeLink,
        MachineKind::NodeLink,
        MachineKind::EdgeRequest,
        MachineKind::NodeRun,
        MachineKind::EdgeCustody,
        MachineKind::EdgeTenants,
        MachineKind::Heartbeat,
        MachineKind::StoreAvailability,
    ];

    /// The stable name used in the header and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            MachineKind::EdgeDispatch => "edge-dispatch",
            MachineKind::EdgeLink => "edge-link",
            MachineKind::NodeLink => "node-link",
            MachineKind::EdgeRequest => "edge-request",
            MachineKind::NodeRun => "node-run",
            MachineKind::EdgeCustody => "edge-custody",
            MachineKind::EdgeTenants => "edge-tenants",
            MachineKind::Heartbeat => "heartbeat",
            MachineKind::StoreAvailability => "store-availability",
        }
    }

    /// Parse a name from the command line.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Parse a `--trace-machine` argument of `iop-edge run` and `iop-node
    /// run`: an unknown name is refused with the list of known ones.
    pub fn from_arg(name: &str) -> Result<Self, String> {
        Self::parse(name).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|k| k.as_str()).collect();
            format!("unknown machine {name:?} (one of {})", known.join(", "))
        })
    }
}

/// The first line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// Always [`TRACE_FORMAT`].
    pub format: String,
    /// Always [`TRACE_VERSION`] for this crate.
    pub version: u32,
    /// The recorded machine.
    pub machine: MachineKind,
    /// Its configuration (one of the `*ConfigRec` types, by `machine`).
    pub config: serde_json::Value,
}

/// What one trace line records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineKind {
    /// An input (or the timer firing).
    In,
    /// An output drained with `poll_output()`.
    Out,
    /// A question the machine answers directly ([`Answers`]).
    Ask,
    /// The answer to the question just asked.
    Answer,
}

impl LineKind {
    const ALL: [LineKind; 4] = [LineKind::In, LineKind::Out, LineKind::Ask, LineKind::Answer];

    fn key(self) -> &'static str {
        match self {
            LineKind::In => "in",
            LineKind::Out => "out",
            LineKind::Ask => "ask",
            LineKind::Answer => "answer",
        }
    }
}

/// A trace line as read back: its kind, time and undecoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct RawLine {
    /// 1-based line number in the file (the header is line 1).
    pub line_no: u64,
    /// Time of the call, microseconds.
    pub t: u64,
    /// Which kind of record.
    pub kind: LineKind,
    /// The payload.
    pub value: serde_json::Value,
}

/// A trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("reading the trace failed: {0}")]
    Io(#[from] std::io::Error),
    /// The file is empty.
    #[error("the trace is empty (no header line)")]
    Empty,
    /// A line is not the JSON this format expects.
    #[error("line {line_no}: {message}")]
    Malformed {
        /// 1-based line number.
        line_no: u64,
        /// What is wrong.
        message: String,
    },
    /// The header names another format or an unsupported version.
    #[error("unsupported trace: format {format:?} version {version}")]
    Unsupported {
        /// The header's format.
        format: String,
        /// The header's version.
        version: u32,
    },
}

/// Writes a trace: the header at creation, then one line per call.
///
/// Write errors are kept (the first one) and reported by
/// [`TraceWriter::finish`]; recording never panics the recorded process.
pub struct TraceWriter<W: Write> {
    out: W,
    error: Option<std::io::Error>,
    lines: u64,
}

impl<W: Write> std::fmt::Debug for TraceWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceWriter")
            .field("lines", &self.lines)
            .finish_non_exhaustive()
    }
}

impl<W: Write> TraceWriter<W> {
    /// Start a trace of `machine` built from `config`.
    pub fn new(out: W, machine: MachineKind, config: &impl Serialize) -> Self {
        let mut writer = Self {
            out,
            error: None,
            lines: 0,
        };
        let header = TraceHeader {
            format: TRACE_FORMAT.into(),
            version: TRACE_VERSION,
            machine,
            config: serde_json::to_value(config).unwrap_or(serde_json::Value::Null),
        };
        match serde_json::to_string(&header) {
            Ok(line) => writer.write_line(&line),
            Err(e) => writer.error = Some(std::io::Error::other(e)),
        }
        writer
    }

    fn write_line(&mut self, line: &str) {
        if self.error.is_some() {
            return;
        }
        if let Err(e) = self
            .out
            .write_all(line.as_bytes())
            .and_then(|()| self.out.write_all(b"\n"))
        {
            self.error = Some(e);
        }
        self.lines += 1;
    }

    /// Lines written so far, header included.
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Flush and report the first write error, if any.
    pub fn finish(mut self) -> Result<W, std::io::Error> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Where a [`Tap`] sends its lines.
pub trait TraceSink: Send {
    /// One complete JSON line (without the newline).
    fn line(&mut self, line: &str);
}

impl<W: Write + Send> TraceSink for TraceWriter<W> {
    fn line(&mut self, line: &str) {
        self.write_line(line);
    }
}

/// A recording point attached to one machine: serializes each call into a
/// trace line and hands it to its sinks. [`Tap::off`] records nothing and
/// serializes nothing.
#[derive(Default)]
pub struct Tap {
    sinks: Vec<Box<dyn TraceSink>>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap")
            .field("sinks", &self.sinks.len())
            .finish()
    }
}

impl Tap {
    /// Record nothing.
    pub fn off() -> Self {
        Self::default()
    }

    /// Record into `sink`.
    pub fn to(sink: impl TraceSink + 'static) -> Self {
        Self {
            sinks: vec![Box::new(sink)],
        }
    }

    /// Also record into `sink`.
    pub fn add(&mut self, sink: Box<dyn TraceSink>) {
        self.sinks.push(sink);
    }

    /// Whether anything is recorded.
    pub fn is_on(&self) -> bool {
        !self.sinks.is_empty()
    }

    fn emit<T: Serialize>(&mut self, now: Instant, kind: LineKind, value: &T) {
        if self.sinks.is_empty() {
            return;
        }
        let line = match serde_json::to_value(value) {
            Ok(value) => {
                let mut map = serde_json::Map::new();
                map.insert("t".into(), serde_json::Value::from(now.as_micros()));
                map.insert(kind.key().into(), value);
                serde_json::Value::Object(map).to_string()
            }
            // Every mirror type serializes; keep the trace well-formed anyway.
            Err(e) => format!(
                "{{\"t\":{},\"error\":{}}}",
                now.as_micros(),
                serde_json::Value::from(e.to_string())
            ),
        };
        for sink in &mut self.sinks {
            sink.line(&line);
        }
    }
}

/// Reads a trace written by [`TraceWriter`].
#[derive(Debug)]
pub struct TraceReader<R: BufRead> {
    input: R,
    header: TraceHeader,
    line_no: u64,
    buf: String,
}

impl<R: BufRead> TraceReader<R> {
    /// Read and check the header.
    pub fn new(mut input: R) -> Result<Self, TraceError> {
        let mut buf = String::new();
        if read_bounded_line(&mut input, &mut buf, 1)? == 0 {
            return Err(TraceError::Empty);
        }
        let header: TraceHeader =
            serde_json::from_str(buf.trim_end()).map_err(|e| TraceError::Malformed {
                line_no: 1,
                message: format!("bad header: {e}"),
            })?;
        if header.format != TRACE_FORMAT || header.version != TRACE_VERSION {
            return Err(TraceError::Unsupported {
                format: header.format,
                version: header.version,
            });
        }
        Ok(Self {
            input,
            header,
            line_no: 1,
            buf,
        })
    }

    /// The header.
    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    /// The next line, `None` at the end. Blank lines are skipped.
    pub fn next_line(&mut self) -> Option<Result<RawLine, TraceError>> {
        loop {
            self.buf.clear();
            self.line_no += 1;
            match read_bounded_line(&mut self.input, &mut self.buf, self.line_no) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => return Some(Err(e)),
            }
            let text = self.buf.trim();
            if text.is_empty() {
                continue;
            }
            return Some(parse_line(self.line_no, text));
        }
    }
}

fn read_bounded_line(
    input: &mut impl BufRead,
    buf: &mut String,
    line_no: u64,
) -> Result<usize, TraceError> {
    let mut bytes = Vec::new();
    let n = std::io::Read::take(&mut *input, MAX_TRACE_LINE_BYTES as u64 + 1)
        .read_until(b'\n', &mut bytes)?;
    if bytes.len() > MAX_TRACE_LINE_BYTES {
        return Err(TraceError::Malformed {
            line_no,
            message: format!("line longer than {MAX_TRACE_LINE_BYTES} bytes"),
        });
    }
    let text = String::from_utf8(bytes).map_err(|_| TraceError::Malformed {
        line_no,
        message: "not UTF-8".into(),
    })?;
    buf.push_str(&text);
    Ok(n)
}

fn parse_line(line_no: u64, text: &str) -> Result<RawLine, TraceError> {
    let malformed = |message: String| TraceError::Malformed { line_no, message };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| malformed(format!("not JSON: {e}")))?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(malformed("not a JSON object".into()));
    };
    let t = map
        .remove("t")
        .and_then(|t| t.as_u64())
        .ok_or_else(|| malformed("missing time \"t\"".into()))?;
    let mut found = None;
    for kind in LineKind::ALL {
        if let Some(v) = map.remove(kind.key()) {
            if found.is_some() {
                return Err(malformed("more than one of in, out, ask, answer".into()));
            }
            found = Some((kind, v));
        }
    }
    let (kind, value) = found.ok_or_else(|| malformed("none of in, out, ask, answer".into()))?;
    Ok(RawLine {
        line_no,
        t,
        kind,
        value,
    })
}

// ---------------------------------------------------------------------------
// edge-dispatch
// ---------------------------------------------------------------------------

/// What builds a fresh [`Dispatcher`]: the `config` of an `edge-dispatch`
/// trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchConfigRec {
    /// The dispatcher's configuration.
    pub config: DispatchConfig,
    /// When the dispatcher was created, microseconds.
    pub created_us: u64,
}

impl DispatchConfigRec {
    /// The record of a dispatcher built from `config` at `created_at`.
    pub fn new(config: &DispatchConfig, created_at: Instant) -> Self {
        Self {
            config: config.clone(),
            created_us: created_at.as_micros(),
        }
    }
}

/// One recorded step of a machine: an input, or its timer firing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step<I> {
    /// [`Machine::handle_input`].
    Input(I),
    /// [`Machine::handle_timeout`].
    HandleTimeout,
}

/// A [`Step`] by reference: serializes exactly as the `Step` it borrows
/// (so recording an input needs no copy of it).
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum StepRef<'a, I> {
    Input(&'a I),
    HandleTimeout,
}

/// One recorded step of the dispatcher.
pub type DispatchStep = Step<DispatchInput>;

/// A machine as its driver holds it: the one driver helper every shell
/// task and the simulator use for every [`Machine`].
///
/// It owns the machine and its [`Tap`], and carries out the crate docs'
/// driver loop the same way everywhere:
///
/// 1. feed an input with [`Driven::handle_input`] (recorded as an `in`
///    line);
/// 2. drain the outputs with [`Driven::drain`] into a closure, or one at a
///    time with [`Driven::poll_output`] where carrying one out feeds the
///    machine again or awaits (each recorded as an `out` line when
///    drained);
/// 3. wait until [`Driven::poll_timeout`], then [`Driven::handle_timeout`]
///    (a shell, after its timer) or [`Driven::fire_due`] (the simulator,
///    stepping time), and drain again.
///
/// A question the machine answers directly ([`Answers`]) is asked with
/// [`Driven::ask`] (recorded as an `ask` line and its `answer`), and what
/// else it caused drained after like an input's outputs.
///
/// With [`Tap::off`] nothing is serialized: the cost is one branch per
/// call. Read access goes through [`Driven::machine`]; a question the
/// machine answers directly and that is not recorded (documented on the
/// machine, such as [`NodeLink::open_lease`]: a secret) through
/// [`Driven::machine_mut`].
#[derive(Debug)]
pub struct Driven<M> {
    machine: M,
    tap: Tap,
}

/// The dispatcher, driven.
pub type DrivenDispatcher = Driven<Dispatcher>;

/// The node's connection machine, driven.
pub type DrivenNodeLink = Driven<NodeLink>;

impl<M> Driven<M>
where
    M: Machine,
    M::Input: Serialize,
    M::Output: Serialize,
{
    /// Drive `machine`, recording into `tap`. The tap's sinks must already
    /// have the header (see [`TraceWriter::new`] with the machine's config
    /// record).
    pub fn new(machine: M, tap: Tap) -> Self {
        Self { machine, tap }
    }

    /// The machine (read access).
    pub fn machine(&self) -> &M {
        &self.machine
    }

    /// The machine, for a query it answers directly (not recorded, so it
    /// must be one the machine documents as such; see
    /// [`NodeLink::open_lease`]).
    pub fn machine_mut(&mut self) -> &mut M {
        &mut self.machine
    }

    /// The machine, no longer driven.
    pub fn into_machine(self) -> M {
        self.machine
    }

    /// Whether anything is recorded.
    pub fn is_recorded(&self) -> bool {
        self.tap.is_on()
    }

    /// [`Machine::handle_input`], recorded.
    pub fn handle_input(&mut self, now: Instant, input: M::Input) {
        self.tap.emit(now, LineKind::In, &StepRef::Input(&input));
        self.machine.handle_input(now, input);
    }

    /// [`Machine::handle_timeout`], recorded.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.tap
            .emit(now, LineKind::In, &StepRef::<M::Input>::HandleTimeout);
        self.machine.handle_timeout(now);
    }

    /// [`Machine::poll_timeout`]: when the timer is due (not recorded).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.machine.poll_timeout()
    }

    /// Whether the timer is due at `now`.
    pub fn is_due(&self, now: Instant) -> bool {
        self.machine.poll_timeout().is_some_and(|at| at <= now)
    }

    /// Fire the timer if it is due at `now` (recorded only then); whether
    /// it fired.
    pub fn fire_due(&mut self, now: Instant) -> bool {
        let due = self.is_due(now);
        if due {
            self.handle_timeout(now);
        }
        due
    }

    /// [`Machine::poll_output`], recorded at `now`.
    #[must_use]
    pub fn poll_output(&mut self, now: Instant) -> Option<M::Output> {
        let out = self.machine.poll_output()?;
        self.tap.emit(now, LineKind::Out, &out);
        Some(out)
    }

    /// Drain every output at `now` into `sink`, in order.
    pub fn drain(&mut self, now: Instant, mut sink: impl FnMut(M::Output)) {
        while let Some(out) = self.poll_output(now) {
            sink(out);
        }
    }

    /// Every output at `now`, in order.
    pub fn drain_all(&mut self, now: Instant) -> Vec<M::Output> {
        std::iter::from_fn(|| self.poll_output(now)).collect()
    }

    /// Feed `input` at `now`, then drain every output into `sink`.
    pub fn step(&mut self, now: Instant, input: M::Input, sink: impl FnMut(M::Output)) {
        self.handle_input(now, input);
        self.drain(now, sink);
    }

    /// Feed one recorded step (replay).
    pub fn apply(&mut self, now: Instant, step: Step<M::Input>) {
        match step {
            Step::Input(input) => self.handle_input(now, input),
            Step::HandleTimeout => self.handle_timeout(now),
        }
    }
}

impl<M> Driven<M>
where
    M: Answers,
    M::Input: Serialize,
    M::Output: Serialize,
    M::Query: Serialize,
    M::Answer: Serialize,
{
    /// [`Answers::answer`], recorded: the question as an `ask` line, the
    /// return value as its `answer`. Drain the outputs after.
    pub fn ask(&mut self, now: Instant, query: M::Query) -> M::Answer {
        self.tap.emit(now, LineKind::Ask, &query);
        let answer = self.machine.answer(now, query);
        self.tap.emit(now, LineKind::Answer, &answer);
        answer
    }
}

impl Driven<Dispatcher> {
    /// A dispatcher built from `config`, recording into `tap`. The tap's
    /// sinks must already have the header (see [`TraceWriter::new`] with
    /// [`DispatchConfigRec`]).
    pub fn new_dispatcher(
        now: Instant,
        config: DispatchConfig,
        tap: Tap,
    ) -> Result<Self, iop_core::edge::health::HealthTrackerError> {
        Ok(Self::new(Dispatcher::new(now, config)?, tap))
    }
}

// ---------------------------------------------------------------------------
// node-link
// ---------------------------------------------------------------------------

/// What builds a fresh [`NodeLink`]: the `config` of a `node-link` trace.
/// (The lease replay cache is not recorded: opening a lease is a query, not
/// an input.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLinkConfigRec {
    /// The connection's settings.
    pub config: NodeLinkConfig,
    /// When the connection was established, microseconds.
    pub created_us: u64,
    /// The registration it sends first.
    pub register: RegisterRequest,
}

impl Driven<NodeLink> {
    /// A connection established at `now`, recording into `tap` (whose
    /// sinks have the header with [`NodeLinkConfigRec`]).
    pub fn new_link(
        now: Instant,
        config: NodeLinkConfig,
        register: RegisterRequest,
        replay: iop_core::cred::ReplayCache,
        tap: Tap,
    ) -> Self {
        Self::new(NodeLink::new(now, config, register, replay), tap)
    }

    /// [`NodeLink::start_run`], recorded as its [`NodeLinkQuery`] and
    /// [`NodeLinkAnswer`].
    pub fn start_run(&mut self, now: Instant, start: RunStart) -> Result<(), FailureCode> {
        if self.tap.is_on() {
            self.tap
                .emit(now, LineKind::Ask, &NodeLinkQuery::StartRun(start.clone()));
        }
        let started = self.machine.start_run(now, start);
        self.tap
            .emit(now, LineKind::Answer, &NodeLinkAnswer::Started(started));
        started
    }

    /// [`NodeLink::offer`], recorded as its [`NodeLinkQuery`] and
    /// [`NodeLinkAnswer`].
    pub fn offer(
        &mut self,
        now: Instant,
        run_id: iop_core::ids::RunId,
        events: Vec<ProviderEvent>,
    ) -> Vec<Emission> {
        if self.tap.is_on() {
            let query = NodeLinkQuery::Offer {
                run_id,
                events: events.clone(),
            };
            self.tap.emit(now, LineKind::Ask, &query);
        }
        let emissions = self.machine.offer(now, run_id, events);
        if self.tap.is_on() {
            let answer = NodeLinkAnswer::Emissions(emissions.clone());
            self.tap.emit(now, LineKind::Answer, &answer);
        }
        emissions
    }

    /// [`NodeLink::take_observation_seq`], recorded as its
    /// [`NodeLinkQuery`] and [`NodeLinkAnswer`].
    pub fn take_observation_seq(&mut self, now: Instant) -> u64 {
        self.tap
            .emit(now, LineKind::Ask, &NodeLinkQuery::TakeObservationSeq);
        let seq = self.machine.take_observation_seq();
        self.tap
            .emit(now, LineKind::Answer, &NodeLinkAnswer::ObservationSeq(seq));
        seq
    }
}

// ---------------------------------------------------------------------------
// edge-link
// ---------------------------------------------------------------------------

/// What builds a fresh [`EdgeLink`]: the `config` of an `edge-link` trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EdgeLinkConfigRec {
    /// The connection's settings.
    pub config: EdgeLinkConfig,
    /// When the connection was established, microseconds.
    pub created_us: u64,
}

/// The Edge's side of one node connection, driven.
pub type DrivenEdgeLink = Driven<EdgeLink>;

impl Driven<EdgeLink> {
    /// A connection established at `created_us`, recording into `tap`.
    pub fn new_edge_link(config: EdgeLinkConfigRec, tap: Tap) -> Self {
        Self::new(
            EdgeLink::new(Instant::from_micros(config.created_us), config.config),
            tap,
        )
    }
}

// ---------------------------------------------------------------------------
// edge-request, node-run, edge-custody, edge-tenants, heartbeat,
// store-availability
// ---------------------------------------------------------------------------

/// How a [`Request`] began: which constructor built it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestBegin {
    /// [`Request::new`]: a client's request.
    New,
    /// [`Request::adopting`]: a takeover adopting a parked run (R-PARK-2).
    Adopting {
        /// The node's report.
        offer: ParkedOffer,
        /// The journal's last event.
        last_seq: u64,
        /// The run's frame that event came from.
        resume_after_frame: u64,
        /// The answer so far, when the route continues a lost adoption.
        resumed: Option<ResumedAnswer>,
    },
    /// [`Request::continuing`]: a takeover continuing an orphan on its
    /// pool (R-TAKE-1, R-CONT-1).
    Continuing {
        /// What its journal holds.
        resumed: ResumedAnswer,
    },
}

/// What builds a fresh [`Request`]: the `config` of an `edge-request`
/// trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestConfigRec {
    /// What the request was created with.
    pub spec: RequestSpec,
    /// How it began.
    pub begin: RequestBegin,
    /// When it was created, microseconds.
    pub created_us: u64,
}

impl RequestConfigRec {
    /// The record of a request begun so from `spec` at `created_at`.
    pub fn new(spec: RequestSpec, begin: RequestBegin, created_at: Instant) -> Self {
        Self {
            spec,
            begin,
            created_us: created_at.as_micros(),
        }
    }

    /// The request it records, fresh.
    pub fn build(&self) -> Request {
        self.clone().into_request()
    }

    /// The request it records.
    pub fn into_request(self) -> Request {
        let now = Instant::from_micros(self.created_us);
        let spec = self.spec;
        match &self.begin {
            RequestBegin::New => Request::new(now, spec),
            RequestBegin::Adopting {
                offer,
                last_seq,
                resume_after_frame,
                resumed,
            } => Request::adopting(
                now,
                spec,
                offer,
                *last_seq,
                *resume_after_frame,
                resumed.as_ref(),
            ),
            RequestBegin::Continuing { resumed } => Request::continuing(now, spec, resumed),
        }
    }
}

/// What builds a fresh [`NodeRun`]: the `config` of a `node-run` trace.
/// Its frames are a normalized run's events or a tunnel's frames, by
/// `spec.kind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRunConfigRec {
    /// The run as its request asked for it.
    pub spec: RunSpec,
}

impl NodeRunConfigRec {
    /// The run it records, fresh, writing frames `F`.
    pub fn build<F: RunFrame>(&self) -> NodeRun<F> {
        NodeRun::new(self.spec.clone())
    }
}

/// What builds a fresh [`Custody`]: the `config` of an `edge-custody`
/// trace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CustodyConfigRec {
    /// The custody's settings.
    pub config: CustodyConfig,
    /// When it was created, microseconds.
    pub created_us: u64,
}

impl CustodyConfigRec {
    /// The custody it records, fresh.
    pub fn build(&self) -> Custody {
        Custody::new(Instant::from_micros(self.created_us), self.config.clone())
    }
}

/// What builds a fresh [`Tenants`]: the `config` of an `edge-tenants`
/// trace. Such a trace is not replayed (see [`ReplayError::NotReplayable`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TenantsConfigRec {
    /// The machine's settings.
    pub config: TenantsConfig,
}

/// What builds a fresh [`Heartbeat`]: the `config` of a `heartbeat` trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatConfigRec {
    /// The heartbeat's interval and wait.
    pub config: HeartbeatConfig,
    /// When it started, microseconds.
    pub created_us: u64,
}

impl HeartbeatConfigRec {
    /// The heartbeat it records, fresh.
    pub fn build(&self) -> Heartbeat {
        Heartbeat::new(Instant::from_micros(self.created_us), self.config)
    }
}

/// What builds a fresh [`Availability`]: the `config` of a
/// `store-availability` trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AvailabilityConfigRec {
    /// When the Edge started, microseconds.
    pub created_us: u64,
    /// The seed of its backoff's jitter.
    pub seed: u64,
}

impl AvailabilityConfigRec {
    /// The machine it records, fresh.
    pub fn build(&self) -> Availability {
        Availability::new(Instant::from_micros(self.created_us), self.seed)
    }
}

// ---------------------------------------------------------------------------
// replay
// ---------------------------------------------------------------------------

/// The first place where a replay differed from its trace.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line_no}: expected {expected}, the fresh machine produced {actual}")]
pub struct Divergence {
    /// 1-based line number of the recorded line.
    pub line_no: u64,
    /// The recorded line's payload (JSON).
    pub expected: String,
    /// What the fresh machine produced (JSON, or `nothing`).
    pub actual: String,
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The machine diverged from the trace.
    #[error("diverged at {0}")]
    Diverged(Divergence),
    /// The trace's config cannot build the machine.
    #[error("bad machine config in the trace header: {0}")]
    Config(String),
    /// The machine answers queries that change it without an input
    /// ([`Tenants`]' admission, reservations and settlements, asked
    /// directly under the Edge's lock), so its inputs alone do not
    /// rebuild it: its trace is read, not replayed.
    #[error("a {} trace is not replayed: the machine answers queries that are not inputs", .0.as_str())]
    NotReplayable(MachineKind),
}

/// What a successful replay checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayReport {
    /// The replayed machine.
    pub machine: MachineKind,
    /// Inputs fed.
    pub inputs: u64,
    /// Outputs compared.
    pub checked: u64,
}

fn to_value(v: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

fn config_of<T: DeserializeOwned>(header: &TraceHeader) -> Result<T, TraceError> {
    serde_json::from_value(header.config.clone()).map_err(|e| TraceError::Malformed {
        line_no: 1,
        message: format!("bad {} config: {e}", header.machine.as_str()),
    })
}

/// Replay a trace: build a fresh machine from its header, feed every input,
/// and compare every recorded return value and output with what the fresh
/// machine produces. Returns the first divergence as an error.
pub fn replay<R: BufRead>(reader: TraceReader<R>) -> Result<ReplayReport, ReplayError> {
    let header = reader.header().clone();
    match header.machine {
        MachineKind::EdgeDispatch => {
            let config: DispatchConfigRec = config_of(&header)?;
            let machine = DrivenDispatcher::new_dispatcher(
                Instant::from_micros(config.created_us),
                config.config,
                Tap::off(),
            )
            .map_err(|e| ReplayError::Config(e.to_string()))?;
            replay_with(reader, machine, header.machine)
        }
        MachineKind::NodeLink => {
            let config: NodeLinkConfigRec = config_of(&header)?;
            let machine = DrivenNodeLink::new_link(
                Instant::from_micros(config.created_us),
                config.config,
                config.register,
                iop_core::cred::ReplayCache::new(),
                Tap::off(),
            );
            replay_lines(reader, machine, header.machine, ask_recorded)
        }
        MachineKind::EdgeLink => {
            let config: EdgeLinkConfigRec = config_of(&header)?;
            replay_with(
                reader,
                DrivenEdgeLink::new_edge_link(config, Tap::off()),
                header.machine,
            )
        }
        MachineKind::EdgeRequest => {
            let config: RequestConfigRec = config_of(&header)?;
            replay_with(
                reader,
                Driven::new(config.build(), Tap::off()),
                header.machine,
            )
        }
        MachineKind::NodeRun => {
            let config: NodeRunConfigRec = config_of(&header)?;
            match config.spec.kind {
                RunKind::Normalized => replay_with(
                    reader,
                    Driven::new(config.build::<RunEventKind>(), Tap::off()),
                    header.machine,
                ),
                RunKind::Tunnel => replay_with(
                    reader,
                    Driven::new(config.build::<ProviderTunnelFrame>(), Tap::off()),
                    header.machine,
                ),
            }
        }
        MachineKind::EdgeCustody => {
            let config: CustodyConfigRec = config_of(&header)?;
            replay_with(
                reader,
                Driven::new(config.build(), Tap::off()),
                header.machine,
            )
        }
        MachineKind::Heartbeat => {
            let config: HeartbeatConfigRec = config_of(&header)?;
            replay_with(
                reader,
                Driven::new(config.build(), Tap::off()),
                header.machine,
            )
        }
        MachineKind::StoreAvailability => {
            let config: AvailabilityConfigRec = config_of(&header)?;
            replay_with(
                reader,
                Driven::new(config.build(), Tap::off()),
                header.machine,
            )
        }
        MachineKind::EdgeTenants => Err(ReplayError::NotReplayable(header.machine)),
    }
}

/// Asks one recorded question again: its answer (JSON), or why the line
/// is not a question this machine answers.
type Asker<M> = fn(&mut Driven<M>, Instant, serde_json::Value) -> Result<serde_json::Value, String>;

/// A machine that answers no recorded question: an `ask` line is malformed.
fn no_questions<M>(
    _: &mut Driven<M>,
    _: Instant,
    _: serde_json::Value,
) -> Result<serde_json::Value, String> {
    Err("this machine answers no recorded question".into())
}

/// Ask a recorded question of an [`Answers`] machine.
fn ask_recorded<M>(
    machine: &mut Driven<M>,
    now: Instant,
    query: serde_json::Value,
) -> Result<serde_json::Value, String>
where
    M: Answers,
    M::Input: Serialize,
    M::Output: Serialize,
    M::Query: Serialize + DeserializeOwned,
    M::Answer: Serialize,
{
    let query: M::Query = serde_json::from_value(query).map_err(|e| e.to_string())?;
    Ok(to_value(&machine.ask(now, query)))
}

fn replay_with<R: BufRead, M>(
    reader: TraceReader<R>,
    machine: Driven<M>,
    kind: MachineKind,
) -> Result<ReplayReport, ReplayError>
where
    M: Machine,
    M::Input: Serialize + DeserializeOwned,
    M::Output: Serialize,
{
    replay_lines(reader, machine, kind, no_questions)
}

fn replay_lines<R: BufRead, M>(
    mut reader: TraceReader<R>,
    mut machine: Driven<M>,
    kind: MachineKind,
    ask: Asker<M>,
) -> Result<ReplayReport, ReplayError>
where
    M: Machine,
    M::Input: Serialize + DeserializeOwned,
    M::Output: Serialize,
{
    // The answer of the question just asked, to compare with its line.
    let mut answered: Option<serde_json::Value> = None;
    let mut report = ReplayReport {
        machine: kind,
        inputs: 0,
        checked: 0,
    };
    while let Some(line) = reader.next_line() {
        let line = line?;
        let now = Instant::from_micros(line.t);
        match line.kind {
            LineKind::In => {
                let step: Step<M::Input> =
                    serde_json::from_value(line.value).map_err(|e| TraceError::Malformed {
                        line_no: line.line_no,
                        message: format!("bad {} input: {e}", kind.as_str()),
                    })?;
                machine.apply(now, step);
                report.inputs += 1;
            }
            LineKind::Out => {
                let actual = machine.poll_output(now).map(|o| to_value(&o));
                if actual.as_ref() != Some(&line.value) {
                    return Err(diverged(line.line_no, &line.value, actual.as_ref()));
                }
                report.checked += 1;
            }
            LineKind::Ask => {
                let answer =
                    ask(&mut machine, now, line.value).map_err(|e| TraceError::Malformed {
                        line_no: line.line_no,
                        message: format!("bad {} question: {e}", kind.as_str()),
                    })?;
                answered = Some(answer);
                report.inputs += 1;
            }
            LineKind::Answer => {
                let actual = answered.take();
                if actual.as_ref() != Some(&line.value) {
                    return Err(diverged(line.line_no, &line.value, actual.as_ref()));
                }
                report.checked += 1;
            }
        }
    }
    Ok(report)
}

fn diverged(
    line_no: u64,
    expected: &serde_json::Value,
    actual: Option<&serde_json::Value>,
) -> ReplayError {
    ReplayError::Diverged(Divergence {
        line_no,
        expected: expected.to_string(),
        actual: actual.map_or_else(|| "nothing".to_owned(), ToString::to_string),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use iop_core::edge::link::EdgeLinkInput;
    use iop_core::liveness::heartbeat::HeartbeatConfig;
    use iop_core::node::link::NodeLinkInput;
    use iop_wire::NodeControl;

    use super::*;

    fn assert_send<T: Send>() {}

    /// The shells own these in tokio tasks.
    #[test]
    fn traced_machines_and_writers_are_send() {
        assert_send::<DrivenDispatcher>();
        assert_send::<DrivenNodeLink>();
        assert_send::<DrivenEdgeLink>();
        assert_send::<Driven<Request>>();
        assert_send::<Driven<NodeRun<RunEventKind>>>();
        assert_send::<Driven<Custody>>();
        assert_send::<Driven<iop_core::tenant::Tenants>>();
        assert_send::<Driven<Availability>>();
        assert_send::<TraceFiles>();
        assert_send::<TraceWriter<std::io::BufWriter<std::fs::File>>>();
    }

    #[test]
    fn an_edge_link_trace_round_trips_through_writer_reader_and_replay() {
        let config = EdgeLinkConfigRec {
            config: EdgeLinkConfig {
                heartbeat: HeartbeatConfig {
                    interval: Duration::from_millis(100),
                    wait: Duration::from_millis(150),
                },
                handshake_timeout: None,
            },
            created_us: 0,
        };
        let register = RegisterRequest {
            protocol_version: iop_wire::PROTOCOL_VERSION,
            node_version: "t".into(),
            providers: vec![],
            max_concurrent_runs: 1,
            recipient_public_key: None,
            parked: vec![],
        };
        let snapshot = iop_wire::ConfigSnapshot::default();
        let buf = SharedBuf::default();
        {
            let writer = TraceWriter::new(buf.clone(), MachineKind::EdgeLink, &config);
            let mut link = DrivenEdgeLink::new_edge_link(config, Tap::to(writer));
            let at = Instant::from_millis;
            let drain = |link: &mut DrivenEdgeLink, t: u64| {
                while link.poll_output(at(t)).is_some() {}
            };
            link.handle_input(
                at(1),
                EdgeLinkInput::Control(NodeControl::Register(register)),
            );
            drain(&mut link, 1);
            link.handle_input(at(2), EdgeLinkInput::Registered(Ok((3, snapshot))));
            link.handle_input(
                at(3),
                EdgeLinkInput::Control(NodeControl::Ready(iop_wire::NodeReadyRequest {
                    generation: 3,
                })),
            );
            link.handle_input(at(4), EdgeLinkInput::ReadyAnswer { accepted: true });
            drain(&mut link, 4);
            link.handle_timeout(at(104));
            drain(&mut link, 104);
            link.handle_timeout(at(254));
            drain(&mut link, 254);
        }
        let bytes = buf.0.lock().map(|b| b.clone()).unwrap_or_default();
        let text = String::from_utf8(bytes).expect("utf-8");
        assert!(text.starts_with(r#"{"format":"iop-trace","version":3,"machine":"edge-link""#));
        assert!(
            text.contains(r#"{"out":{"connected":3},"t":4000}"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"{"out":{"end":{"code":"HeartbeatTimeout","generation":3}},"t":254000}"#
            ),
            "{text}"
        );
        let report = replay(TraceReader::new(text.as_bytes()).expect("header")).expect("replays");
        assert_eq!(report.inputs, 6);
    }

    /// A node connection's direct answers (a run's start, its offer, an
    /// observation number) are recorded as `ask` and `answer` lines and
    /// asked again by the replay, which catches a changed answer (R-WD-6).
    #[test]
    fn a_node_link_trace_records_and_replays_its_direct_answers() {
        use iop_core::node::link::NodeLinkConfig;
        use iop_core::node::watchdog::{ProviderOutcome, RunKind, WatchdogConfig};
        use iop_wire::{EdgeControl, NodeReadyResponse, RegisterResponse};

        let config = NodeLinkConfigRec {
            config: NodeLinkConfig {
                heartbeat: HeartbeatConfig {
                    interval: Duration::from_secs(1),
                    wait: Duration::from_secs(2),
                },
                watchdog: WatchdogConfig {
                    close_grace: Duration::from_millis(200),
                    probe_bound: Duration::from_millis(300),
                    max_active_runs: 4,
                },
                handshake_timeout: None,
            },
            created_us: 0,
            register: RegisterRequest {
                protocol_version: iop_wire::PROTOCOL_VERSION,
                node_version: "t".into(),
                providers: vec![],
                max_concurrent_runs: 4,
                recipient_public_key: None,
                parked: vec![],
            },
        };
        let buf = SharedBuf::default();
        {
            let writer = TraceWriter::new(buf.clone(), MachineKind::NodeLink, &config);
            let at = Instant::from_millis;
            let mut link = DrivenNodeLink::new_link(
                at(0),
                config.config,
                config.register.clone(),
                iop_core::cred::ReplayCache::new(),
                Tap::to(writer),
            );
            link.drain(at(0), |_| {});
            link.handle_input(
                at(1),
                NodeLinkInput::Control(EdgeControl::Registered(RegisterResponse::Accepted {
                    generation: 3,
                    config: iop_wire::ConfigSnapshot::default(),
                })),
            );
            link.handle_input(
                at(1),
                NodeLinkInput::Control(EdgeControl::ReadyAck(NodeReadyResponse {
                    generation: 3,
                    accepted: true,
                })),
            );
            link.drain(at(1), |_| {});
            let start = RunStart {
                run_id: 1,
                kind: RunKind::Normalized,
                stall_timeout: Duration::from_secs(1),
                deadline: None,
                adapter: iop_wire::AdapterKind::Mock,
                target: "m".into(),
                carries_lease: false,
            };
            assert_eq!(link.start_run(at(2), start.clone()), Ok(()));
            assert_eq!(
                link.start_run(at(2), start),
                Err(FailureCode::InvalidRequest)
            );
            let done = vec![ProviderEvent::Returned(ProviderOutcome::Completed)];
            assert_eq!(link.offer(at(3), 1, done), vec![Emission::Forward]);
            // The run's end is an output, drained after the answer.
            assert_eq!(link.drain_all(at(3)).len(), 1);
            assert_eq!(link.take_observation_seq(at(4)), 1);
        }
        let bytes = buf.0.lock().map(|b| b.clone()).unwrap_or_default();
        let text = String::from_utf8(bytes).expect("utf-8");
        assert!(
            text.contains(r#"{"answer":{"emissions":["forward"]},"t":3000}"#),
            "{text}"
        );
        assert!(
            text.contains(r#"{"ask":"take_observation_seq","t":4000}"#),
            "{text}"
        );
        let report = replay(TraceReader::new(text.as_bytes()).expect("header")).expect("replays");
        assert_eq!(report.machine, MachineKind::NodeLink);
        // 2 inputs + 4 questions; 2 drained outputs + 4 answers (the
        // registration, `Ready`, ... as drained).
        assert_eq!(report.inputs, 6);
        let changed = text.replace(
            r#"{"answer":{"emissions":["forward"]},"t":3000}"#,
            r#"{"answer":{"emissions":["fenced"]},"t":3000}"#,
        );
        assert!(matches!(
            replay(TraceReader::new(changed.as_bytes()).expect("header")),
            Err(ReplayError::Diverged(d)) if d.expected.contains("fenced")
        ));
    }

    /// A buffer the test reads back after the writer is gone.
    #[derive(Clone, Default)]
    struct SharedBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for SharedBuf {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut b) = self.0.lock() {
                b.extend_from_slice(bytes);
            }
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
