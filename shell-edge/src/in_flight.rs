//! Requests in flight, as an operator and the request's own record see
//! them.
//!
//! Every request driver keeps one [`RequestView`]: its route, model and
//! phase, its attempt and provider, the time it waited for capacity and
//! spent on providers, its first content, and the usage and finish reason
//! its answer reported. The driver is its one writer; two readers take it:
//!
//! * `/status` and the console list the requests of the [`InFlight`] table
//!   (oldest first, at most [`MAX_LISTED_REQUESTS`]);
//! * the request's [`crate::request_record::RequestRecord`] reads it for the
//!   `Server-Timing` header and the GenAI attributes and metrics of the
//!   request ([`crate::observe`]).
//!
//! A view holds closed values, configured names and the client's model
//! name cut to [`MAX_MODEL_CHARS`]; never a prompt, an output or a key.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use iop_core::edge::gate::GateFailure;
use iop_core::edge::request::RequestPhase;
use iop_core::ids::ProviderId;
use iop_wire::{FailureCode, FinishReason, RunEventKind, Usage};
use serde_json::{Value, json};

/// The most requests `/status` lists (the oldest first); the count is
/// always whole.
pub const MAX_LISTED_REQUESTS: usize = 100;

/// The most characters of a client's model name a view keeps.
pub const MAX_MODEL_CHARS: usize = 64;

/// What is known of one request while it runs (see the module docs).
#[derive(Debug)]
pub struct RequestView {
    route: &'static str,
    model: String,
    streamed: bool,
    started: Instant,
    started_unix_ms: u64,
    state: Mutex<Shared>,
}

/// A request's progress, written by its driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Where it is.
    pub phase: RequestPhase,
    /// Attempts started.
    pub attempts: u32,
    /// Whether the answer was committed (its first content went out).
    pub committed: bool,
    /// Time spent waiting for capacity leases, over every attempt.
    pub queued: Duration,
    /// Time spent in attempts that ended (from the attempt's start to its
    /// end), over every attempt.
    pub provider: Duration,
    /// When the attempt in flight started.
    pub attempt_started: Option<Instant>,
    /// When a lease wait in progress started.
    pub queue_started: Option<Instant>,
    /// From the request's start to its first committed content.
    pub first_content: Option<Duration>,
    /// The usage the answer reported (summed over its attempts).
    pub usage: Option<Usage>,
    /// Why generation finished.
    pub finish_reason: Option<FinishReason>,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            phase: RequestPhase::Queued,
            attempts: 0,
            committed: false,
            queued: Duration::ZERO,
            provider: Duration::ZERO,
            attempt_started: None,
            queue_started: None,
            first_content: None,
            usage: None,
            finish_reason: None,
        }
    }
}

/// A request's progress with its provider, as read at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressRead {
    /// The progress.
    pub progress: Progress,
    /// The provider of the latest attempt.
    pub provider_id: Option<ProviderId>,
    /// Time waited for capacity, a wait in progress included.
    pub queued: Duration,
    /// Time spent on providers, the attempt in flight included.
    pub provider: Duration,
}

#[derive(Debug, Default)]
struct Shared {
    progress: Progress,
    provider_id: Option<ProviderId>,
    /// The failure the client was told.
    failure: Option<&'static str>,
    /// How the latest attempt that failed ended.
    last_attempt_failure: Option<&'static str>,
    /// The durable response it writes.
    response_id: Option<String>,
}

impl RequestView {
    /// The view of a request on `route` for `model` that starts now;
    /// `streamed`: its answer is sent as it comes.
    pub fn new(route: &'static str, model: &str, streamed: bool) -> Arc<Self> {
        Self::since(route, model, streamed, Instant::now())
    }

    /// The view of a request that arrived at `started` (its times count
    /// from there).
    pub fn since(route: &'static str, model: &str, streamed: bool, started: Instant) -> Arc<Self> {
        let age_ms = millis(started.elapsed());
        Arc::new(RequestView {
            route,
            model: model.chars().take(MAX_MODEL_CHARS).collect(),
            streamed,
            started,
            started_unix_ms: iop_transport::clock::unix_ms().saturating_sub(age_ms),
            state: Mutex::new(Shared::default()),
        })
    }

    /// It writes the durable response `id`.
    pub fn set_response_id(&self, id: &str) {
        self.shared().response_id = Some(id.to_owned());
    }

    fn shared(&self) -> MutexGuard<'_, Shared> {
        // Values are replaced whole: a panic while holding the lock leaves
        // them consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Its route class.
    pub fn route(&self) -> &'static str {
        self.route
    }

    /// The model the client asked for (cut to [`MAX_MODEL_CHARS`]).
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether the answer is sent as it comes.
    pub fn streamed(&self) -> bool {
        self.streamed
    }

    /// When it started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Its progress now.
    pub fn read(&self) -> ProgressRead {
        self.read_at(Instant::now())
    }

    /// Its progress at `now`: a wait or an attempt in progress counts up to
    /// `now`.
    pub fn read_at(&self, now: Instant) -> ProgressRead {
        let shared = self.shared();
        let p = shared.progress;
        ProgressRead {
            queued: p.queued + p.queue_started.map_or(Duration::ZERO, |at| now - at),
            provider: p.provider + p.attempt_started.map_or(Duration::ZERO, |at| now - at),
            provider_id: shared.provider_id.clone(),
            progress: p,
        }
    }

    /// The driver's machine is in `phase`, after `attempts` attempts,
    /// `committed` or not.
    pub fn set_phase(&self, phase: RequestPhase, attempts: u32, committed: bool) {
        let mut s = self.shared();
        s.progress.phase = phase;
        s.progress.attempts = attempts;
        s.progress.committed = committed;
    }

    /// A wait for a capacity lease starts.
    pub fn queue_started(&self) {
        self.shared().progress.queue_started = Some(Instant::now());
    }

    /// The wait for a lease ended (granted or not).
    pub fn queue_ended(&self) {
        let mut s = self.shared();
        if let Some(at) = s.progress.queue_started.take() {
            s.progress.queued += at.elapsed();
        }
    }

    /// Attempt `number` starts on `provider`.
    pub fn attempt_started(&self, provider: &ProviderId, number: u32) {
        let mut s = self.shared();
        s.progress.attempt_started = Some(Instant::now());
        s.progress.attempts = s.progress.attempts.max(number);
        s.provider_id = Some(provider.clone());
    }

    /// The attempt in flight ended: `None` completed, else why not.
    pub fn attempt_ended(&self, failure: Option<FailureCode>) {
        let mut s = self.shared();
        if let Some(at) = s.progress.attempt_started.take() {
            s.progress.provider += at.elapsed();
        }
        if let Some(code) = failure {
            s.last_attempt_failure = Some(code.as_str());
        }
    }

    /// The request failed with `failure` (what its client is told).
    pub fn failed(&self, failure: GateFailure) {
        self.shared().failure = Some(failure.as_str());
    }

    /// The closed class of the failure its client was told, if any.
    pub fn failure(&self) -> Option<&'static str> {
        self.shared().failure
    }

    /// How its latest failed attempt ended, if one failed.
    pub fn last_attempt_failure(&self) -> Option<&'static str> {
        self.shared().last_attempt_failure
    }

    /// The answer was committed: its first content goes out now.
    pub fn committed(&self) {
        let mut s = self.shared();
        s.progress.committed = true;
        if s.progress.first_content.is_none() {
            s.progress.first_content = Some(self.started.elapsed());
        }
    }

    /// An event the client is sent: its usage and finish reason are the
    /// answer's.
    pub fn delivered(&self, event: &RunEventKind) {
        match event {
            RunEventKind::Usage(usage) => self.shared().progress.usage = Some(*usage),
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                let mut s = self.shared();
                s.progress.finish_reason = Some(*finish_reason);
                if let Some(usage) = usage {
                    s.progress.usage = Some(*usage);
                }
            }
            _ => {}
        }
    }

    /// The `/status` row of this request at `now`.
    fn status_json(&self, now: Instant, now_unix_ms: u64) -> Value {
        let read = self.read_at(now);
        let p = read.progress;
        // R-OBS-1: a durable response by its log tag, never its id.
        let response = self
            .shared()
            .response_id
            .as_deref()
            .map(iop_core::edge::client_ids::log_tag);
        json!({
            "route": self.route,
            "model": self.model,
            "phase": p.phase.as_str(),
            "committed": p.committed,
            "attempt": p.attempts,
            "provider": read.provider_id.as_ref().map(ProviderId::as_str),
            "started_at": self.started_unix_ms,
            "age_ms": now_unix_ms.saturating_sub(self.started_unix_ms),
            "queued_ms": millis(read.queued),
            "provider_ms": millis(read.provider),
            "streamed": self.streamed,
            "response": response,
        })
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The requests this Edge runs now.
#[derive(Debug, Default)]
pub struct InFlight {
    requests: Mutex<BTreeMap<u64, Arc<RequestView>>>,
    next: AtomicU64,
}

/// A request's place in the [`InFlight`] table: it leaves when this is
/// dropped (its driver ended, however).
#[derive(Debug)]
pub struct InFlightEntry {
    table: Arc<InFlight>,
    key: u64,
    view: Arc<RequestView>,
}

impl InFlightEntry {
    /// The request's view.
    pub fn view(&self) -> &Arc<RequestView> {
        &self.view
    }
}

impl Drop for InFlightEntry {
    fn drop(&mut self) {
        self.table.requests().remove(&self.key);
    }
}

impl InFlight {
    /// An empty table.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn requests(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<RequestView>>> {
        // Entries are inserted and removed whole.
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enter `view` in the table until the returned entry is dropped.
    pub fn enter(self: &Arc<Self>, view: Arc<RequestView>) -> InFlightEntry {
        // Keys in arrival order: the table lists the oldest first.
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        self.requests().insert(key, view.clone());
        InFlightEntry {
            table: self.clone(),
            key,
            view,
        }
    }

    /// Requests in the table.
    pub fn len(&self) -> usize {
        self.requests().len()
    }

    /// Whether no request is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `requests` part of `/status`: how many, and the oldest
    /// [`MAX_LISTED_REQUESTS`] of them.
    pub fn status_json(&self) -> Value {
        let (total, listed): (usize, Vec<Arc<RequestView>>) = {
            let requests = self.requests();
            (
                requests.len(),
                requests
                    .values()
                    .take(MAX_LISTED_REQUESTS)
                    .cloned()
                    .collect(),
            )
        };
        let now = Instant::now();
        let now_unix_ms = iop_transport::clock::unix_ms();
        json!({
            "in_flight": total,
            "listed": listed.iter().map(|v| v.status_json(now, now_unix_ms)).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_listed_while_its_entry_lives_with_its_phase_and_attempt() {
        let table = InFlight::new();
        let view = RequestView::new("chat", "m", true);
        let entry = table.enter(view.clone());
        view.set_phase(RequestPhase::Running, 1, false);
        view.attempt_started(&ProviderId::new("p1"), 1);
        let doc = table.status_json();
        assert_eq!(doc["in_flight"], 1);
        let row = &doc["listed"][0];
        assert_eq!(
            (
                &row["route"],
                &row["phase"],
                &row["attempt"],
                &row["provider"]
            ),
            (&json!("chat"), &json!("running"), &json!(1), &json!("p1"))
        );
        drop(entry);
        assert_eq!(table.status_json()["in_flight"], 0);
        assert!(table.is_empty());
    }

    #[test]
    fn the_listing_is_bounded_and_the_count_is_whole() {
        let table = InFlight::new();
        let entries: Vec<InFlightEntry> = (0..MAX_LISTED_REQUESTS + 5)
            .map(|_| table.enter(RequestView::new("chat", "m", false)))
            .collect();
        let doc = table.status_json();
        assert_eq!(doc["in_flight"], MAX_LISTED_REQUESTS + 5);
        assert_eq!(
            doc["listed"].as_array().map(Vec::len),
            Some(MAX_LISTED_REQUESTS)
        );
        drop(entries);
        assert!(table.is_empty());
    }

    #[test]
    fn a_view_counts_from_the_request_s_arrival() {
        let arrived = Instant::now() - Duration::from_millis(300);
        let table = InFlight::new();
        let _entry = table.enter(RequestView::since("chat", "m", false, arrived));
        let age = table.status_json()["listed"][0]["age_ms"].as_u64();
        assert!(age >= Some(300), "{age:?}");
    }

    #[test]
    fn a_long_model_name_is_cut_on_a_character_boundary() {
        let long = "é".repeat(MAX_MODEL_CHARS * 2);
        let view = RequestView::new("chat", &long, false);
        assert_eq!(view.model().chars().count(), MAX_MODEL_CHARS);
    }

    #[test]
    fn waits_and_attempts_in_progress_count_up_to_the_moment_read() {
        let view = RequestView::new("chat", "m", false);
        view.queue_started();
        view.queue_ended();
        let queued = view.read().queued;
        view.attempt_started(&ProviderId::new("p1"), 1);
        let later = Instant::now() + Duration::from_millis(250);
        let read = view.read_at(later);
        assert_eq!(read.queued, queued, "the wait ended");
        assert!(read.provider >= Duration::from_millis(250), "{read:?}");
        view.attempt_ended(None);
        let closed = view.read().provider;
        assert_eq!(
            view.read_at(later + Duration::from_secs(1)).provider,
            closed,
            "an ended attempt no longer counts up"
        );
    }

    #[test]
    fn the_answer_usage_and_finish_reason_are_the_last_delivered() {
        let view = RequestView::new("chat", "m", false);
        let usage = Usage::tokens;
        view.delivered(&RunEventKind::Usage(usage(3, 1)));
        view.delivered(&RunEventKind::Completed {
            finish_reason: FinishReason::Length,
            usage: None,
        });
        let p = view.read().progress;
        assert_eq!(
            p.usage,
            Some(usage(3, 1)),
            "a terminal without usage keeps it"
        );
        assert_eq!(p.finish_reason, Some(FinishReason::Length));
        view.delivered(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(3, 4)),
        });
        assert_eq!(view.read().progress.usage, Some(usage(3, 4)));
    }
}
