//! The trace format: a versioned JSON-lines record of one core state
//! machine's inputs and outputs, and its replay.
//!
//! ## Format (version 1)
//!
//! A trace is UTF-8 text, one JSON object per line.
//!
//! * Line 1, the header:
//!   `{"format":"iop-trace","version":1,"machine":"edge-dispatch","config":{...}}`.
//!   `machine` is one of [`MachineKind`]'s names (`edge-dispatch`,
//!   `node-watchdog`, `heartbeat`); `config` is everything needed to build a
//!   fresh machine ([`DispatchConfigRec`], [`WatchdogConfigRec`],
//!   [`HeartbeatConfigRec`]).
//! * Every later line is one of
//!   * `{"in":INPUT,"t":T}`: the driver fed `INPUT` at `T` microseconds
//!     ([`iop_core::Instant::as_micros`]);
//!   * `{"ret":VALUE,"t":T}`: what that input call returned (every input of
//!     a machine whose inputs return a value has exactly one `ret` line,
//!     right after it);
//!   * `{"out":OUTPUT,"t":T}`: the driver drained `OUTPUT` with
//!     `poll_output()` at `T`.
//!
//!   Key order is not significant (the writer sorts keys); blank lines are
//!   ignored; a line may be at most [`MAX_TRACE_LINE_BYTES`] long.
//!
//! Outputs are recorded *when the driver drains them*, not when the machine
//! queues them, so a replay drains at exactly the same points and the two
//! sequences compare line by line. `poll_timeout()` is not recorded: a timer
//! firing appears as the `handle_timeout` input.
//!
//! The dispatcher's inputs and outputs are the core enums themselves
//! ([`DispatchInput`] inside a [`DispatchStep`], [`DispatchOutput`]); its
//! inputs return nothing, so an `edge-dispatch` trace has no `ret` lines.
//! The watchdog's and heartbeat's outputs are their core enums too
//! (`WatchdogOutput`, `HeartbeatOutput`); their inputs are method calls,
//! recorded as one enum per machine in this module ([`WatchdogInput`],
//! [`HeartbeatInput`], with [`WatchdogRet`] for what a call returned). All
//! are externally tagged in `snake_case`; wire types (`iop_wire`) appear as
//! they serialize themselves.
//!
//! ## Recording
//!
//! Wrap the machine in [`TracedDispatcher`], [`TracedWatchdog`] or
//! [`TracedHeartbeat`] with a [`Tap`] over a [`TraceWriter`]. The wrappers
//! expose the core API unchanged (core types in, core types out) and write a
//! line per call; with [`Tap::off`] they cost nothing.
//!
//! ## Replay
//!
//! [`replay`] reads a trace with [`TraceReader`], builds a fresh machine from
//! the header, feeds every `in` line, and checks every `ret` and `out` line
//! against what the fresh machine produces. The first difference is reported
//! as a [`Divergence`] with its line number.

use std::collections::BTreeSet;
use std::io::{BufRead, Write};
use std::time::Duration;

use iop_core::Instant;
use iop_core::edge::admission::{AdmissionConfig, ProviderSpec};
use iop_core::edge::dispatch::{DispatchConfig, DispatchInput, DispatchOutput, Dispatcher};
use iop_core::ids::{Generation, NodeId, ProviderId, RunId};
use iop_core::liveness::heartbeat::{Heartbeat, HeartbeatConfig, HeartbeatOutput};
use iop_core::node::session::ObservationSequence;
use iop_core::node::watchdog::{
    CancelReason, Emission, ProbeOutcome, Progress, ProviderEvent, ProviderOutcome, RunKind,
    Watchdog, WatchdogConfig, WatchdogError, WatchdogOutput,
};
use iop_wire::ExecutionFailure;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The `format` value of every trace header.
pub const TRACE_FORMAT: &str = "iop-trace";

/// The trace format version this crate writes and reads.
pub const TRACE_VERSION: u32 = 1;

/// The longest trace line [`TraceReader`] accepts, in bytes (bounded input).
pub const MAX_TRACE_LINE_BYTES: usize = 1 << 20;

/// Which core machine a trace records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MachineKind {
    /// [`iop_core::edge::dispatch::Dispatcher`].
    #[serde(rename = "edge-dispatch")]
    EdgeDispatch,
    /// [`iop_core::node::watchdog::Watchdog`] (with its observation sequence).
    #[serde(rename = "node-watchdog")]
    NodeWatchdog,
    /// [`iop_core::liveness::heartbeat::Heartbeat`] (either side).
    #[serde(rename = "heartbeat")]
    Heartbeat,
}

impl MachineKind {
    /// Every kind.
    pub const ALL: [MachineKind; 3] = [
        MachineKind::EdgeDispatch,
        MachineKind::NodeWatchdog,
        MachineKind::Heartbeat,
    ];

    /// The stable name used in the header and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            MachineKind::EdgeDispatch => "edge-dispatch",
            MachineKind::NodeWatchdog => "node-watchdog",
            MachineKind::Heartbeat => "heartbeat",
        }
    }

    /// Parse a name from the command line.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
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
    /// An input call.
    In,
    /// The value the last input call returned.
    Ret,
    /// An output drained with `poll_output()`.
    Out,
}

impl LineKind {
    fn key(self) -> &'static str {
        match self {
            LineKind::In => "in",
            LineKind::Ret => "ret",
            LineKind::Out => "out",
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
    for kind in [LineKind::In, LineKind::Ret, LineKind::Out] {
        if let Some(v) = map.remove(kind.key()) {
            if found.is_some() {
                return Err(malformed("more than one of in/ret/out".into()));
            }
            found = Some((kind, v));
        }
    }
    let (kind, value) = found.ok_or_else(|| malformed("none of in/ret/out".into()))?;
    Ok(RawLine {
        line_no,
        t,
        kind,
        value,
    })
}

// ---------------------------------------------------------------------------
// Mirrors shared by several machines.
// ---------------------------------------------------------------------------

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------
// edge-dispatch
// ---------------------------------------------------------------------------

/// [`DispatchConfig`], serializable: the `config` of an `edge-dispatch`
/// trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchConfigRec {
    /// Queue capacity.
    pub queue_capacity: usize,
    /// Queue timeout, microseconds.
    pub queue_timeout_us: u64,
    /// Every configured provider.
    pub providers: Vec<ProviderSpec>,
    /// Generations start above this.
    pub generation_floor: Generation,
    /// Only these nodes may register (`None`: any).
    pub known_nodes: Option<Vec<NodeId>>,
    /// Health tracker: refresh, backoff base, backoff cap, stale-after and
    /// probe timeout, microseconds.
    pub health_us: [u64; 5],
    /// When the dispatcher was created, microseconds.
    pub created_us: u64,
    /// Providers whose capacity comes from their node's registration.
    #[serde(default)]
    pub capacity_from_node: Vec<ProviderId>,
}

impl From<&DispatchConfig> for DispatchConfigRec {
    fn from(c: &DispatchConfig) -> Self {
        Self {
            queue_capacity: c.admission.queue_capacity,
            queue_timeout_us: us(c.admission.queue_timeout),
            providers: c.providers.clone(),
            generation_floor: c.generation_floor,
            known_nodes: c.known_nodes.as_ref().map(|k| k.iter().cloned().collect()),
            health_us: [
                us(c.health.refresh_interval),
                us(c.health.backoff_base),
                us(c.health.backoff_cap),
                us(c.health.stale_after),
                us(c.health.probe_timeout),
            ],
            created_us: 0,
            capacity_from_node: c.capacity_from_node.iter().cloned().collect(),
        }
    }
}

impl From<&DispatchConfigRec> for DispatchConfig {
    fn from(c: &DispatchConfigRec) -> Self {
        Self {
            admission: AdmissionConfig {
                queue_capacity: c.queue_capacity,
                queue_timeout: Duration::from_micros(c.queue_timeout_us),
            },
            providers: c.providers.clone(),
            generation_floor: c.generation_floor,
            known_nodes: c
                .known_nodes
                .as_ref()
                .map(|k| k.iter().cloned().collect::<BTreeSet<_>>()),
            health: iop_core::edge::health::HealthConfig {
                refresh_interval: Duration::from_micros(c.health_us[0]),
                backoff_base: Duration::from_micros(c.health_us[1]),
                backoff_cap: Duration::from_micros(c.health_us[2]),
                stale_after: Duration::from_micros(c.health_us[3]),
                probe_timeout: Duration::from_micros(c.health_us[4]),
            },
            capacity_from_node: c.capacity_from_node.iter().cloned().collect(),
        }
    }
}

/// One recorded step of the dispatcher: an input, or its timer firing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchStep {
    /// [`Dispatcher::handle_input`].
    Input(DispatchInput),
    /// [`Dispatcher::handle_timeout`].
    HandleTimeout,
}

/// A [`Dispatcher`] that records every input and drained output into its
/// [`Tap`], as the core types themselves. Read access goes through
/// [`TracedDispatcher::inner`].
#[derive(Debug)]
pub struct TracedDispatcher {
    inner: Dispatcher,
    tap: Tap,
}

impl TracedDispatcher {
    /// A dispatcher built from `config`, recording into `tap`. The tap's
    /// sinks must already have the header (see [`TraceWriter::new`] with
    /// [`DispatchConfigRec`]).
    pub fn new(
        now: Instant,
        config: DispatchConfig,
        tap: Tap,
    ) -> Result<Self, iop_core::edge::health::HealthTrackerError> {
        Ok(Self {
            inner: Dispatcher::new(now, config)?,
            tap,
        })
    }

    /// The wrapped dispatcher (read access).
    pub fn inner(&self) -> &Dispatcher {
        &self.inner
    }

    /// [`Dispatcher::handle_input`], recorded.
    pub fn handle_input(&mut self, now: Instant, input: DispatchInput) {
        if self.tap.is_on() {
            self.tap
                .emit(now, LineKind::In, &DispatchStep::Input(input.clone()));
        }
        self.inner.handle_input(now, input);
    }

    /// [`Dispatcher::handle_timeout`], recorded.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.tap
            .emit(now, LineKind::In, &DispatchStep::HandleTimeout);
        self.inner.handle_timeout(now);
    }

    /// [`Dispatcher::poll_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.inner.poll_timeout()
    }

    /// [`Dispatcher::poll_output`], recorded at `now`.
    #[must_use]
    pub fn poll_output(&mut self, now: Instant) -> Option<DispatchOutput> {
        let out = self.inner.poll_output()?;
        self.tap.emit(now, LineKind::Out, &out);
        Some(out)
    }

    /// Feed one recorded step (replay).
    pub fn apply(&mut self, now: Instant, step: DispatchStep) {
        match step {
            DispatchStep::Input(input) => self.handle_input(now, input),
            DispatchStep::HandleTimeout => self.handle_timeout(now),
        }
    }
}

// ---------------------------------------------------------------------------
// node-watchdog
// ---------------------------------------------------------------------------

/// [`WatchdogConfig`] plus whether the watchdog has an observation sequence:
/// the `config` of a `node-watchdog` trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchdogConfigRec {
    /// Close grace, microseconds.
    pub close_grace_us: u64,
    /// Probe bound, microseconds.
    pub probe_bound_us: u64,
    /// Most runs watched at once.
    pub max_active_runs: usize,
    /// Whether the watchdog has a (fresh) connection observation sequence.
    pub bound_sequence: bool,
}

impl WatchdogConfigRec {
    /// Mirror a config.
    pub fn new(config: &WatchdogConfig, bound_sequence: bool) -> Self {
        Self {
            close_grace_us: us(config.close_grace),
            probe_bound_us: us(config.probe_bound),
            max_active_runs: config.max_active_runs,
            bound_sequence,
        }
    }

    /// The core config.
    pub fn config(&self) -> WatchdogConfig {
        WatchdogConfig {
            close_grace: Duration::from_micros(self.close_grace_us),
            probe_bound: Duration::from_micros(self.probe_bound_us),
            max_active_runs: self.max_active_runs,
        }
    }
}

/// [`ProviderEvent`], serializable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderEventRec {
    /// Progress.
    Progress(Progress),
    /// Forwarded, not progress.
    Neutral,
    /// The call returned normally.
    Completed,
    /// The call failed.
    Failed(ExecutionFailure),
}

impl From<&ProviderEvent> for ProviderEventRec {
    fn from(e: &ProviderEvent) -> Self {
        match e {
            ProviderEvent::Progress(p) => Self::Progress(*p),
            ProviderEvent::Neutral => Self::Neutral,
            ProviderEvent::Returned(ProviderOutcome::Completed) => Self::Completed,
            ProviderEvent::Returned(ProviderOutcome::Failed(f)) => Self::Failed(f.clone()),
        }
    }
}

impl From<ProviderEventRec> for ProviderEvent {
    fn from(e: ProviderEventRec) -> Self {
        match e {
            ProviderEventRec::Progress(p) => Self::Progress(p),
            ProviderEventRec::Neutral => Self::Neutral,
            ProviderEventRec::Completed => Self::Returned(ProviderOutcome::Completed),
            ProviderEventRec::Failed(f) => Self::Returned(ProviderOutcome::Failed(f)),
        }
    }
}

/// An input of the watchdog (one method call).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchdogInput {
    /// [`Watchdog::start`].
    Start {
        /// Run.
        run_id: RunId,
        /// Normalized or tunnel.
        kind: RunKind,
        /// Effective stall timeout, microseconds.
        stall_timeout_us: u64,
        /// Hard deadline, microseconds since the origin.
        deadline_us: Option<u64>,
    },
    /// [`Watchdog::provider_event`] (also how `progress`, `neutral` and
    /// `provider_returned` calls are recorded).
    ProviderEvent {
        /// Run.
        run_id: RunId,
        /// The classified output.
        event: ProviderEventRec,
    },
    /// [`Watchdog::probe_result`].
    ProbeResult {
        /// Run.
        run_id: RunId,
        /// Verdict.
        outcome: ProbeOutcome,
    },
    /// [`Watchdog::cancel`].
    Cancel {
        /// Run.
        run_id: RunId,
        /// Why.
        reason: CancelReason,
    },
    /// [`Watchdog::cancel_all`].
    CancelAll {
        /// Why.
        reason: CancelReason,
    },
    /// [`Watchdog::handle_timeout`].
    HandleTimeout,
    /// [`Watchdog::take_observation_seq`].
    TakeObservationSeq,
}

/// [`WatchdogError`], serializable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchdogErrorRec {
    /// Duplicate run.
    DuplicateRun,
    /// Finished run reused.
    FinishedRun,
    /// At the limit.
    TooManyRuns,
    /// A kind this crate does not know yet.
    Other(String),
}

impl From<&WatchdogError> for WatchdogErrorRec {
    fn from(e: &WatchdogError) -> Self {
        match e {
            WatchdogError::DuplicateRun { .. } => Self::DuplicateRun,
            WatchdogError::FinishedRun { .. } => Self::FinishedRun,
            WatchdogError::TooManyRuns { .. } => Self::TooManyRuns,
            other => Self::Other(other.to_string()),
        }
    }
}

/// What a watchdog input call returned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchdogRet {
    /// `start` answer.
    Started(Result<(), WatchdogErrorRec>),
    /// `provider_event` answer.
    Emission(Emission),
    /// `take_observation_seq` answer.
    Seq(Option<u64>),
    /// Methods returning nothing.
    Done,
}

/// A [`Watchdog`] that records every call into its [`Tap`].
#[derive(Debug)]
pub struct TracedWatchdog {
    inner: Watchdog,
    tap: Tap,
}

impl TracedWatchdog {
    /// A watchdog built from `config`, recording into `tap`.
    pub fn new(config: WatchdogConfigRec, tap: Tap) -> Self {
        let sequence = config.bound_sequence.then(ObservationSequence::new);
        Self {
            inner: Watchdog::new(config.config(), sequence),
            tap,
        }
    }

    /// The wrapped watchdog (read access).
    pub fn inner(&self) -> &Watchdog {
        &self.inner
    }

    fn record(&mut self, now: Instant, input: WatchdogInput) {
        self.tap.emit(now, LineKind::In, &input);
    }

    fn ret(&mut self, now: Instant, ret: WatchdogRet) {
        self.tap.emit(now, LineKind::Ret, &ret);
    }

    /// [`Watchdog::start`].
    pub fn start(
        &mut self,
        now: Instant,
        run_id: RunId,
        kind: RunKind,
        stall_timeout: Duration,
        deadline: Option<Instant>,
    ) -> Result<(), WatchdogError> {
        if self.tap.is_on() {
            self.record(
                now,
                WatchdogInput::Start {
                    run_id,
                    kind,
                    stall_timeout_us: us(stall_timeout),
                    deadline_us: deadline.map(Instant::as_micros),
                },
            );
        }
        let r = self.inner.start(now, run_id, kind, stall_timeout, deadline);
        if self.tap.is_on() {
            let ret = WatchdogRet::Started(r.as_ref().map(|_| ()).map_err(WatchdogErrorRec::from));
            self.ret(now, ret);
        }
        r
    }

    /// [`Watchdog::provider_event`].
    pub fn provider_event(
        &mut self,
        now: Instant,
        run_id: RunId,
        event: ProviderEvent,
    ) -> Emission {
        if self.tap.is_on() {
            self.record(
                now,
                WatchdogInput::ProviderEvent {
                    run_id,
                    event: (&event).into(),
                },
            );
        }
        let r = self.inner.provider_event(now, run_id, event);
        if self.tap.is_on() {
            self.ret(now, WatchdogRet::Emission(r));
        }
        r
    }

    /// [`Watchdog::progress`], recorded as a `provider_event`.
    pub fn progress(&mut self, now: Instant, run_id: RunId, progress: Progress) -> Emission {
        self.provider_event(now, run_id, ProviderEvent::Progress(progress))
    }

    /// [`Watchdog::neutral`], recorded as a `provider_event`.
    pub fn neutral(&mut self, now: Instant, run_id: RunId) -> Emission {
        self.provider_event(now, run_id, ProviderEvent::Neutral)
    }

    /// [`Watchdog::provider_returned`], recorded as a `provider_event`.
    pub fn provider_returned(
        &mut self,
        now: Instant,
        run_id: RunId,
        outcome: ProviderOutcome,
    ) -> Emission {
        self.provider_event(now, run_id, ProviderEvent::Returned(outcome))
    }

    /// [`Watchdog::probe_result`].
    pub fn probe_result(&mut self, now: Instant, run_id: RunId, outcome: ProbeOutcome) {
        if self.tap.is_on() {
            self.record(now, WatchdogInput::ProbeResult { run_id, outcome });
        }
        self.inner.probe_result(now, run_id, outcome);
        if self.tap.is_on() {
            self.ret(now, WatchdogRet::Done);
        }
    }

    /// [`Watchdog::cancel`].
    pub fn cancel(&mut self, now: Instant, run_id: RunId, reason: CancelReason) {
        if self.tap.is_on() {
            self.record(now, WatchdogInput::Cancel { run_id, reason });
        }
        self.inner.cancel(now, run_id, reason);
        if self.tap.is_on() {
            self.ret(now, WatchdogRet::Done);
        }
    }

    /// [`Watchdog::cancel_all`].
    pub fn cancel_all(&mut self, now: Instant, reason: CancelReason) {
        if self.tap.is_on() {
            self.record(now, WatchdogInput::CancelAll { reason });
        }
        self.inner.cancel_all(now, reason);
        if self.tap.is_on() {
            self.ret(now, WatchdogRet::Done);
        }
    }

    /// [`Watchdog::handle_timeout`].
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.tap.is_on() {
            self.record(now, WatchdogInput::HandleTimeout);
        }
        self.inner.handle_timeout(now);
        if self.tap.is_on() {
            self.ret(now, WatchdogRet::Done);
        }
    }

    /// [`Watchdog::take_observation_seq`].
    pub fn take_observation_seq(&mut self, now: Instant) -> Option<u64> {
        if self.tap.is_on() {
            self.record(now, WatchdogInput::TakeObservationSeq);
        }
        let r = self.inner.take_observation_seq();
        if self.tap.is_on() {
            self.ret(now, WatchdogRet::Seq(r));
        }
        r
    }

    /// [`Watchdog::poll_timeout`] (not recorded).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.inner.poll_timeout()
    }

    /// [`Watchdog::poll_output`], recorded at `now`.
    #[must_use]
    pub fn poll_output(&mut self, now: Instant) -> Option<WatchdogOutput> {
        let out = self.inner.poll_output()?;
        if self.tap.is_on() {
            self.tap.emit(now, LineKind::Out, &out);
        }
        Some(out)
    }

    /// Feed one recorded input (replay).
    pub fn apply(&mut self, now: Instant, input: WatchdogInput) -> WatchdogRet {
        match input {
            WatchdogInput::Start {
                run_id,
                kind,
                stall_timeout_us,
                deadline_us,
            } => WatchdogRet::Started(
                self.start(
                    now,
                    run_id,
                    kind,
                    Duration::from_micros(stall_timeout_us),
                    deadline_us.map(Instant::from_micros),
                )
                .as_ref()
                .map(|_| ())
                .map_err(WatchdogErrorRec::from),
            ),
            WatchdogInput::ProviderEvent { run_id, event } => {
                WatchdogRet::Emission(self.provider_event(now, run_id, event.into()))
            }
            WatchdogInput::ProbeResult { run_id, outcome } => {
                self.probe_result(now, run_id, outcome);
                WatchdogRet::Done
            }
            WatchdogInput::Cancel { run_id, reason } => {
                self.cancel(now, run_id, reason);
                WatchdogRet::Done
            }
            WatchdogInput::CancelAll { reason } => {
                self.cancel_all(now, reason);
                WatchdogRet::Done
            }
            WatchdogInput::HandleTimeout => {
                self.handle_timeout(now);
                WatchdogRet::Done
            }
            WatchdogInput::TakeObservationSeq => WatchdogRet::Seq(self.take_observation_seq(now)),
        }
    }
}

// ---------------------------------------------------------------------------
// heartbeat
// ---------------------------------------------------------------------------

/// [`HeartbeatConfig`] and the moment the connection was established: the
/// `config` of a `heartbeat` trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatConfigRec {
    /// Ping interval, microseconds.
    pub interval_us: u64,
    /// Pong wait, microseconds.
    pub wait_us: u64,
    /// [`Heartbeat::new`]'s `now`, microseconds.
    pub created_at_us: u64,
}

impl HeartbeatConfigRec {
    /// Mirror a config.
    pub fn new(config: &HeartbeatConfig, created_at: Instant) -> Self {
        Self {
            interval_us: us(config.interval),
            wait_us: us(config.wait),
            created_at_us: created_at.as_micros(),
        }
    }

    /// The core config.
    pub fn config(&self) -> HeartbeatConfig {
        HeartbeatConfig {
            interval: Duration::from_micros(self.interval_us),
            wait: Duration::from_micros(self.wait_us),
        }
    }
}

/// An input of the heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeartbeatInput {
    /// [`Heartbeat::handle_ping`].
    Ping {
        /// Sequence.
        seq: u64,
    },
    /// [`Heartbeat::handle_pong`].
    Pong {
        /// Sequence.
        seq: u64,
    },
    /// [`Heartbeat::handle_timeout`].
    HandleTimeout,
}

/// What a heartbeat input call returned (always nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeartbeatRet {
    /// Nothing.
    Done,
}

/// A [`Heartbeat`] that records every call into its [`Tap`].
#[derive(Debug)]
pub struct TracedHeartbeat {
    inner: Heartbeat,
    tap: Tap,
}

impl TracedHeartbeat {
    /// A heartbeat built from `config`, recording into `tap`.
    pub fn new(config: HeartbeatConfigRec, tap: Tap) -> Self {
        Self {
            inner: Heartbeat::new(Instant::from_micros(config.created_at_us), config.config()),
            tap,
        }
    }

    /// The wrapped heartbeat (read access).
    pub fn inner(&self) -> &Heartbeat {
        &self.inner
    }

    /// Feed one input.
    pub fn apply(&mut self, now: Instant, input: HeartbeatInput) -> HeartbeatRet {
        self.tap.emit(now, LineKind::In, &input);
        match input {
            HeartbeatInput::Ping { seq } => self.inner.handle_ping(now, seq),
            HeartbeatInput::Pong { seq } => self.inner.handle_pong(now, seq),
            HeartbeatInput::HandleTimeout => self.inner.handle_timeout(now),
        }
        self.tap.emit(now, LineKind::Ret, &HeartbeatRet::Done);
        HeartbeatRet::Done
    }

    /// [`Heartbeat::handle_ping`].
    pub fn handle_ping(&mut self, now: Instant, seq: u64) {
        let _ = self.apply(now, HeartbeatInput::Ping { seq });
    }

    /// [`Heartbeat::handle_pong`].
    pub fn handle_pong(&mut self, now: Instant, seq: u64) {
        let _ = self.apply(now, HeartbeatInput::Pong { seq });
    }

    /// [`Heartbeat::handle_timeout`].
    pub fn handle_timeout(&mut self, now: Instant) {
        let _ = self.apply(now, HeartbeatInput::HandleTimeout);
    }

    /// [`Heartbeat::poll_timeout`] (not recorded).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.inner.poll_timeout()
    }

    /// [`Heartbeat::poll_output`], recorded at `now`.
    #[must_use]
    pub fn poll_output(&mut self, now: Instant) -> Option<HeartbeatOutput> {
        let out = self.inner.poll_output()?;
        self.tap.emit(now, LineKind::Out, &out);
        Some(out)
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
}

/// What a successful replay checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayReport {
    /// The replayed machine.
    pub machine: MachineKind,
    /// Inputs fed.
    pub inputs: u64,
    /// Return values and outputs compared.
    pub checked: u64,
}

trait Replayable {
    type Input: DeserializeOwned;
    fn apply_value(&mut self, now: Instant, input: Self::Input) -> serde_json::Value;
    fn poll_value(&mut self, now: Instant) -> Option<serde_json::Value>;
}

fn to_value(v: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

impl Replayable for TracedDispatcher {
    type Input = DispatchStep;
    fn apply_value(&mut self, now: Instant, input: DispatchStep) -> serde_json::Value {
        self.apply(now, input);
        serde_json::Value::Null
    }
    fn poll_value(&mut self, now: Instant) -> Option<serde_json::Value> {
        self.poll_output(now).map(|o| to_value(&o))
    }
}

impl Replayable for TracedWatchdog {
    type Input = WatchdogInput;
    fn apply_value(&mut self, now: Instant, input: WatchdogInput) -> serde_json::Value {
        to_value(&self.apply(now, input))
    }
    fn poll_value(&mut self, now: Instant) -> Option<serde_json::Value> {
        self.poll_output(now).map(|o| to_value(&o))
    }
}

impl Replayable for TracedHeartbeat {
    type Input = HeartbeatInput;
    fn apply_value(&mut self, now: Instant, input: HeartbeatInput) -> serde_json::Value {
        to_value(&self.apply(now, input))
    }
    fn poll_value(&mut self, now: Instant) -> Option<serde_json::Value> {
        self.poll_output(now).map(|o| to_value(&o))
    }
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
            let machine = TracedDispatcher::new(
                Instant::from_micros(config.created_us),
                (&config).into(),
                Tap::off(),
            )
            .map_err(|e| ReplayError::Config(e.to_string()))?;
            replay_with(reader, machine, header.machine)
        }
        MachineKind::NodeWatchdog => {
            let config: WatchdogConfigRec = config_of(&header)?;
            replay_with(
                reader,
                TracedWatchdog::new(config, Tap::off()),
                header.machine,
            )
        }
        MachineKind::Heartbeat => {
            let config: HeartbeatConfigRec = config_of(&header)?;
            replay_with(
                reader,
                TracedHeartbeat::new(config, Tap::off()),
                header.machine,
            )
        }
    }
}

fn replay_with<R: BufRead, M: Replayable>(
    mut reader: TraceReader<R>,
    mut machine: M,
    kind: MachineKind,
) -> Result<ReplayReport, ReplayError> {
    let mut report = ReplayReport {
        machine: kind,
        inputs: 0,
        checked: 0,
    };
    let mut pending_ret: Option<serde_json::Value> = None;
    while let Some(line) = reader.next_line() {
        let line = line?;
        let now = Instant::from_micros(line.t);
        match line.kind {
            LineKind::In => {
                let input: M::Input =
                    serde_json::from_value(line.value).map_err(|e| TraceError::Malformed {
                        line_no: line.line_no,
                        message: format!("bad {} input: {e}", kind.as_str()),
                    })?;
                pending_ret = Some(machine.apply_value(now, input));
                report.inputs += 1;
            }
            LineKind::Ret => {
                let actual = pending_ret.take();
                if actual.as_ref() != Some(&line.value) {
                    return Err(diverged(line.line_no, &line.value, actual.as_ref()));
                }
                report.checked += 1;
            }
            LineKind::Out => {
                let actual = machine.poll_value(now);
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
    use super::*;

    fn assert_send<T: Send>() {}

    /// The shells own these in tokio tasks.
    #[test]
    fn traced_machines_and_writers_are_send() {
        assert_send::<TracedDispatcher>();
        assert_send::<TracedWatchdog>();
        assert_send::<TracedHeartbeat>();
        assert_send::<TraceWriter<std::io::BufWriter<std::fs::File>>>();
    }

    #[test]
    fn a_heartbeat_trace_round_trips_through_writer_reader_and_replay() {
        let config = HeartbeatConfigRec::new(
            &HeartbeatConfig {
                interval: Duration::from_millis(100),
                wait: Duration::from_millis(150),
            },
            Instant::ZERO,
        );
        let buf = SharedBuf::default();
        {
            let writer = TraceWriter::new(buf.clone(), MachineKind::Heartbeat, &config);
            let mut hb = TracedHeartbeat::new(config, Tap::to(writer));
            let at = Instant::from_millis;
            hb.handle_timeout(at(100));
            while hb.poll_output(at(100)).is_some() {}
            hb.handle_pong(at(120), 1);
            hb.handle_ping(at(130), 7);
            while hb.poll_output(at(130)).is_some() {}
            hb.handle_timeout(at(200));
            hb.handle_timeout(at(350));
            while hb.poll_output(at(350)).is_some() {}
        }
        let bytes = buf.0.lock().map(|b| b.clone()).unwrap_or_default();
        let text = String::from_utf8(bytes).expect("utf-8");
        assert!(text.starts_with(r#"{"format":"iop-trace","version":1,"machine":"heartbeat""#));
        assert!(
            text.contains(r#"{"out":{"send_pong":7},"t":130000}"#),
            "{text}"
        );
        assert!(text.contains(r#"{"out":"timed_out","t":350000}"#), "{text}");
        let report = replay(TraceReader::new(text.as_bytes()).expect("header")).expect("replays");
        assert_eq!(report.inputs, 5);
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
