//! Tenants in the world (SPEC §9): every Edge process drives the very core
//! [`Tenants`] machine `iop-edge`'s `shell-edge/src/tenancy.rs` drives, and
//! every Edge claims from one shared store of counters
//! ([`crate::tenant_store`]), as several `iop-edge` processes share a NATS
//! key-value bucket.
//!
//! What the world carries, as the shell does:
//!
//! * **Admission**: a client request comes with one of the world's keys
//!   (its principal's) and a prompt; the Edge asks its machine at once
//!   (`Tenants::admit`, a direct answer) before any record or request
//!   exists. Refused: the client's answer is the 429 and nothing else
//!   happens.
//! * **Further attempts** (R-TEN-2): the request machine's
//!   `RequestOutput::ReserveAttempt` is answered at once from
//!   `Tenants::reserve_attempt`.
//! * **Takeovers** (R-TEN-2, R-TAKE-1): a takeover's request (an adoption
//!   or a continuation the custody starts) is held to the key its record
//!   names, with the terms of its stored request, as the shell's
//!   `stored.rs` does: `Tenants::admit_adopted` for an adoption (its run
//!   reserved at once, on credit), `Tenants::admit_taken_over` for a
//!   continuation (each attempt reserves).
//! * **Usage**: the usage the answer reports (summed over its attempts by
//!   the request machine) is recorded from its deliveries; when the request
//!   ends it is settled with it plus the request machine's estimate of what
//!   no report covers (`Request::unmetered`: a cut attempt's prompt and
//!   text), or released if there is neither. A durable answer a takeover
//!   ends without running it is charged what its journal holds when the
//!   custody says so (`CustodyOutput::Charge`, `Tenants::charge_ended`),
//!   as the shell's `stored::charge_ended` does.
//! * **Claims** go to the shared store over a seeded latency, read then
//!   compare-and-set; the answer comes back to the machine of the Edge
//!   process that asked, if it still lives. An Edge that dies loses its
//!   machine, its reservations and its claims' answers.
//! * **Graceful stops** (R-TEN-3): of the Edge restarts the seed makes,
//!   about half are stops (SIGTERM) rather than kills: the machine's
//!   `Tenants::hand_back` gives back its slots and the unused rest of its
//!   windows' chunks (what requests in flight reserved stays counted, as
//!   the shell's stop leaves a durable answer to a takeover), and the
//!   process ends. Each give-back goes to the store as the shell's stop
//!   sends it: a failed one, or one whose answer was lost, is sent again
//!   (`GIVE_BACK_RETRY_MS` apart, at most `MAX_GIVE_BACK_ASKS` times),
//!   and the store applies it once (core's `check_give_back`).
//!
//! Checked after every step ([`World::check_tenants`]) and at each
//! settlement:
//!
//! * **R-TEN-2 (bound)**: the spend recorded for a subject with a budget
//!   (its settled usage rows, over every Edge) never exceeds its limit plus
//!   one chunk per Edge process that reserved from it: an Edge holds what
//!   its claims were granted and spends at most one chunk on credit while
//!   a claim is on its way; a restarted Edge is a new process and holds
//!   nothing, so it may take its chunk on credit again.
//! * **R-TEN-2 (every reservation once)**: every provider call a request
//!   makes is covered by a reservation of its own (its admission's, then
//!   one per further attempt); an attempt answered "reserved" is held by
//!   the machine; a settlement gives back exactly what the request's
//!   reservations held and charges what it used once (per subject and
//!   meter, the machine's counts move by the use minus the reservations);
//!   a settled request holds nothing more, and each admitted request is
//!   settled exactly once.
//! * **R-TEN-2 (every answer charged once)**: an adopted run is covered
//!   by its adoption's reservation; a request that delivers a durable
//!   answer's completion is held to a tenant and its settlement charges at
//!   least the usage the answer reports (its attempts', the adopted run's
//!   included) to the record's key; over every Edge process, one
//!   settlement charges a durable answer's completion, never two.
//! * **R-TEN-2 (what no report covers)**: a request that delivered text
//!   with no usage report is charged at least its prompt (an ephemeral
//!   one); a durable answer a takeover ends `incomplete` after producing
//!   text no journaled usage covers is charged once, on its key, by that
//!   custody, at least its text's estimate and its prompt; a lost adoption
//!   that ends its record with no usage is charged at least the estimate of
//!   all the text its journal holds.
//! * **R-TEN-1 (isolation)**: each Edge process also drives one shadow
//!   machine per principal that sees only that principal's traffic; every
//!   admission and attempt of the principal gets the same answer from the
//!   shared machine as from its shadow, and the shared machine asks the
//!   store for exactly the claims the shadow does: one principal's use
//!   never changes another's admission.
//! * **R-TEN-3**: no counter in the store is claimed past its limit.
//!
//! Requests name one of the profile's models, and keys and principals may
//! hold limits per model (R-TEN-1): their counters are subjects of their
//! own, belonging to the key's or the principal's principal, so every check
//! above covers them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use iop_core::edge::admission::RequestId;
use iop_core::edge::durable::JournaledUse;
use iop_core::edge::request::{Delivery, RequestInput};
use iop_core::journal::{RecordMeta, RecordStatus};
use iop_core::tenant::slots::SlotAsk;
use iop_core::tenant::usage::UsageTotals;
use iop_core::tenant::{
    AdmitRequest, CounterKey, GIVE_BACK_RETRY_MS, GiveBackOutcome, Held, Limits,
    MAX_GIVE_BACK_ASKS, Meter, ModelLimits, Subject, Tenants, TenantsInput, TenantsOutput,
    TokenUse, Unmetered,
};
use iop_wire::RunEventKind;

use super::{Event, World};
use crate::config::{Rng, TenantProfile};
use crate::tenant_store::{MAX_CLAIM_TRIES, SimTenantStore};
use crate::trace::{Driven, MachineKind, TenantsConfigRec};

/// Tenants of the whole world: the profile, the shared store, what was
/// recorded.
#[derive(Debug)]
pub(super) struct SimTenancy {
    profile: TenantProfile,
    store: SimTenantStore,
    /// Draws of the tenants' own (keys, prompts, the store's latency and
    /// faults), so the world's stream is what it was without tenants.
    rng: Rng,
    /// R-TEN-2: spend recorded (settled usage rows) per subject.
    recorded: BTreeMap<Subject, u64>,
    /// The Edge processes that reserved spend of each subject.
    spenders: BTreeMap<Subject, BTreeSet<u64>>,
    /// R-TEN-1 (rates): requests admitted per subject with a requests per
    /// minute limit (a key's, a principal's, each one's for a model) and
    /// minute, over every Edge process.
    admitted: BTreeMap<(Subject, u64), AdmittedInWindow>,
    /// R-TEN-2: each durable record's tenant terms (its key, model and
    /// stored request), which outlive the Edge process that admitted it.
    records: BTreeMap<String, RecordTerms>,
    /// R-TEN-2: settlements that charged each durable answer's completion,
    /// over every Edge process.
    completions_charged: BTreeMap<String, u32>,
    /// R-TEN-2: durable answers whose reported usage a settlement charged
    /// (its request delivered it), over every Edge process: a takeover
    /// that ends such a record must not charge its journaled usage again.
    usage_settled: BTreeSet<String>,
    /// R-TEN-2: durable answers a takeover ended and charged their
    /// journaled usage: a settlement of their request must not charge the
    /// usage it delivered again.
    usage_ended: BTreeSet<String>,
    /// R-TEN-2: charges of durable answers a takeover ended without
    /// running them, over every Edge process, and the last one's totals.
    ended_charged: BTreeMap<String, u32>,
    ended_totals: BTreeMap<String, UsageTotals>,
}

/// What a durable record says of its tenant (the shell reads it from the
/// record's meta and stored request).
#[derive(Debug, Clone)]
struct RecordTerms {
    /// Its key (an index into the profile's keys).
    key: usize,
    /// Its prompt's bytes.
    prompt_bytes: u64,
    /// Its model.
    model: String,
}

/// Requests of one subject admitted in one minute, over every Edge.
#[derive(Debug, Default)]
struct AdmittedInWindow {
    count: u64,
    /// The Edge processes that admitted them.
    processes: BTreeSet<u64>,
    /// Of them, those that admitted some on their local share (the store
    /// taken as unreachable for the subject).
    local: BTreeSet<u64>,
}

/// One claim on its way through the store (see [`crate::tenant_store`]).
#[derive(Debug, Clone)]
pub(super) struct ClaimOp {
    incarnation: u64,
    counter: CounterKey,
    amount: u64,
    limit: u64,
    tries: u32,
    /// What the read found: (claimed, revision); `None`: the read is next.
    read: Option<(u64, u64)>,
}

/// A step of the tenants' store traffic.
#[derive(Debug)]
pub(super) enum TenantEvent {
    /// The claim's next hop reaches the store.
    Store(ClaimOp),
    /// The store's answer reaches the Edge process that asked.
    Answer {
        incarnation: u64,
        counter: CounterKey,
        granted: Option<u64>,
    },
    /// An ask to hold slots of a concurrency gauge reaches the store.
    Slots {
        incarnation: u64,
        counter: CounterKey,
        want: u64,
        limit: u64,
        lease_ms: u64,
    },
    /// The store's answer to it reaches the Edge process that asked.
    SlotsAnswer {
        incarnation: u64,
        counter: CounterKey,
        held: Option<u64>,
    },
    /// A stopping Edge process's give-back reaches the store (its
    /// `tries`-th send).
    GiveBack {
        incarnation: u64,
        counter: CounterKey,
        amount: u64,
        tries: u32,
    },
}

impl TenantEvent {
    /// The Edge process it concerns.
    pub(super) fn incarnation(&self) -> u64 {
        match self {
            TenantEvent::Store(op) => op.incarnation,
            TenantEvent::Answer { incarnation, .. }
            | TenantEvent::Slots { incarnation, .. }
            | TenantEvent::SlotsAnswer { incarnation, .. }
            | TenantEvent::GiveBack { incarnation, .. } => *incarnation,
        }
    }
}

/// One Edge process's tenants.
#[derive(Debug)]
pub(super) struct EdgeTenants {
    /// The machine the Edge's shell drives.
    machine: Driven<Tenants>,
    /// R-TEN-1: per principal, a machine that sees only its traffic.
    shadows: BTreeMap<String, Tenants>,
    /// The requests it admitted and has not settled.
    tickets: BTreeMap<RequestId, Ticket>,
}

/// An admitted request's hold on its tenant's limits.
#[derive(Debug, Clone)]
struct Ticket {
    /// Its key, prompt's bytes and model.
    terms: RecordTerms,
    /// The usage its answer reported so far.
    used: Option<TokenUse>,
    /// Its first reservation: its admission's or its adoption's (a
    /// takeover's continuation holds none until its first attempt).
    first: bool,
    /// Further attempts reserved.
    attempts: u32,
    /// Provider calls sent with its prompt.
    calls: u32,
    /// The subjects with a concurrency limit it was admitted to on this
    /// Edge's local share (the store taken as down for them).
    local: Vec<Subject>,
    /// Its durable record.
    record: Option<String>,
    /// The durable answer's completion it delivered: its usage.
    completed: Option<iop_wire::Usage>,
    /// Tokens no usage report covers, estimated by its machine.
    unmetered: Unmetered,
    /// It delivered text of its answer.
    text: bool,
    /// A takeover's request: it adopted the parked run (else it continues
    /// the answer), writing the record at this epoch.
    takeover: Option<(bool, u64)>,
    /// Held by a takeover: admitted by an Edge that is gone, counted in
    /// flight here without a concurrency slot of its own (R-TEN-1).
    taken_over: bool,
}

impl SimTenancy {
    /// Whether `ticket` is held to `subject`'s concurrency limit as a
    /// takeover holds it: its key's and its principal's, not per model.
    fn ticket_is_of(&self, ticket: &Ticket, subject: &Subject) -> bool {
        let (key, p, _) = &self.profile.keys[ticket.terms.key];
        match subject {
            Subject::Key(k) => k == key,
            Subject::Principal(principal) => *principal == self.profile.principals[*p].0,
            _ => false,
        }
    }

    pub(super) fn new(profile: TenantProfile, seed: u64) -> Self {
        Self {
            profile,
            store: SimTenantStore::new(),
            rng: Rng::new(seed ^ 0x7E4A_4175_5EED_0004),
            recorded: BTreeMap::new(),
            spenders: BTreeMap::new(),
            admitted: BTreeMap::new(),
            records: BTreeMap::new(),
            completions_charged: BTreeMap::new(),
            usage_settled: BTreeSet::new(),
            usage_ended: BTreeSet::new(),
            ended_charged: BTreeMap::new(),
            ended_totals: BTreeMap::new(),
        }
    }
}

/// The holder id of an Edge process in the store's concurrency gauges.
fn holder(incarnation: u64) -> String {
    format!("edge-process-{incarnation}")
}

/// The principal a counter's subject belongs to (a limit per model's
/// too: R-TEN-1's isolation covers them).
fn principal_of<'a>(profile: &'a TenantProfile, subject: &'a Subject) -> &'a str {
    match subject {
        Subject::Principal(p) | Subject::PrincipalModel { principal: p, .. } => p,
        Subject::Key(k) | Subject::KeyModel { key: k, .. } => profile
            .keys
            .iter()
            .find(|(id, ..)| id == k)
            .map_or("", |(_, p, _)| profile.principals[*p].0.as_str()),
    }
}

/// The subjects whose concurrency limits apply to `request`, with the
/// limit (R-TEN-1).
fn concurrent_subjects(request: &AdmitRequest) -> Vec<(Subject, u64)> {
    subjects(
        request,
        |l| l.concurrent_requests,
        |l| l.concurrent_requests,
    )
}

/// The subjects whose requests per minute apply to `request`, with the
/// limit: the key's, the principal's and each one's for the request's
/// model (R-TEN-1), read from the limits themselves, not from what the
/// machine counted.
fn rated_subjects(request: &AdmitRequest) -> Vec<(Subject, u64)> {
    subjects(
        request,
        |l| l.requests_per_minute,
        |l| l.requests_per_minute,
    )
}

/// The key, the principal and each one's subject for the request's model,
/// with the limit `whole` or `per_model` reads from its limits (subjects
/// without that limit left out).
fn subjects(
    request: &AdmitRequest,
    whole: fn(&Limits) -> Option<u64>,
    per_model: fn(&ModelLimits) -> Option<u64>,
) -> Vec<(Subject, u64)> {
    let model = request.model.clone();
    [
        (
            Subject::Key(request.key.clone()),
            whole(&request.key_limits),
        ),
        (
            Subject::Principal(request.principal.clone()),
            whole(&request.principal_limits),
        ),
        (
            Subject::KeyModel {
                key: request.key.clone(),
                model: model.clone(),
            },
            request.key_limits.for_model(&model).and_then(per_model),
        ),
        (
            Subject::PrincipalModel {
                principal: request.principal.clone(),
                model: model.clone(),
            },
            request
                .principal_limits
                .for_model(&model)
                .and_then(per_model),
        ),
    ]
    .into_iter()
    .filter_map(|(s, limit)| Some((s, limit?)))
    .collect()
}

impl World {
    /// A new Edge process's tenants (`None` in a world without them).
    pub(super) fn new_edge_tenants(&mut self) -> Option<EdgeTenants> {
        let config = TenantsConfigRec {
            config: self.tenancy.as_ref()?.profile.machine,
        };
        let tap = self.recorder.tap(MachineKind::EdgeTenants, &config);
        let t = self.tenancy.as_ref()?;
        // The shadows run the same code, planted bugs included: they tell
        // isolation apart, not correctness.
        let machine = || {
            let m = Tenants::new(t.profile.machine);
            self.core_bugs.plant_tenants(&m);
            m
        };
        Some(EdgeTenants {
            machine: Driven::new(machine(), tap),
            shadows: t
                .profile
                .principals
                .iter()
                .map(|(p, _)| (p.clone(), machine()))
                .collect(),
            tickets: BTreeMap::new(),
        })
    }

    /// A client request arrives at the current Edge with one of the
    /// world's keys: admit it (R-TEN-1, R-TEN-2) before anything else.
    /// `false`: refused, its client got the 429 and nothing more happens.
    pub(super) fn tenant_admit(&mut self, rid: RequestId) -> bool {
        let now = self.now;
        let unix_ms = self.unix_ms();
        let Some(t) = self.tenancy.as_mut() else {
            return true;
        };
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return false;
        };
        let Some(et) = edge.tenants.as_mut() else {
            return true;
        };
        let key = t.rng.index(t.profile.keys.len());
        let prompt_bytes = t.rng.range(1, t.profile.prompt_bytes_max);
        let model = t.profile.models[t.rng.index(t.profile.models.len())].clone();
        // The ticket is the request's id (unique per Edge process).
        let (key_id, p, key_limits) = &t.profile.keys[key];
        let (principal, principal_limits) = &t.profile.principals[*p];
        let request = AdmitRequest {
            ticket: rid,
            key: key_id.clone(),
            principal: principal.clone(),
            key_limits: key_limits.clone(),
            principal_limits: principal_limits.clone(),
            price: Some(t.profile.price),
            prompt_tokens_max: iop_core::tenant::prompt_tokens_max(prompt_bytes),
            output_tokens_max: t.profile.output_tokens_max,
            unix_ms,
            model: model.clone(),
            durable: false,
            background: false,
            key_held: Held::default(),
            principal_held: Held::default(),
        };
        let admitted = et.machine.machine_mut().admit(now, &request);
        let shadow = et
            .shadows
            .get_mut(principal)
            .map(|s| s.admit(now, &request));
        let principal = principal.clone();
        // Each limited subject's rate, over every Edge (R-TEN-1): whether
        // this machine takes the store as down for it, before the claims.
        let local: Vec<Subject> = concurrent_subjects(&request)
            .into_iter()
            .map(|(s, _)| s)
            .filter(|s| et.machine.machine().store_down_for(s))
            .collect();
        let rated: Vec<(Subject, u64, bool)> = if admitted.is_ok() {
            rated_subjects(&request)
                .into_iter()
                .map(|(s, limit)| {
                    let local = et.machine.machine().store_down_for(&s);
                    (s, limit, local)
                })
                .collect()
        } else {
            Vec::new()
        };
        if shadow.as_ref() != Some(&admitted) {
            let detail = format!(
                "request {rid} of principal {principal}: the Edge's machine answered \
                 {admitted:?}, one that saw only this principal's traffic {shadow:?}"
            );
            self.checkers[self.cur].fail("R-TEN-1", detail);
        }
        if let Some(edge) = self.edges[self.cur].as_mut()
            && let Some(et) = edge.tenants.as_mut()
            && admitted.is_ok()
        {
            et.tickets.insert(
                rid,
                Ticket {
                    terms: RecordTerms {
                        key,
                        prompt_bytes,
                        model,
                    },
                    used: None,
                    first: true,
                    attempts: 0,
                    calls: 0,
                    local,
                    record: None,
                    completed: None,
                    unmetered: Unmetered::default(),
                    text: false,
                    takeover: None,
                    taken_over: false,
                },
            );
            let incarnation = edge.incarnation;
            let spent: Vec<Subject> = et
                .machine
                .machine()
                .held_by(rid)
                .iter()
                .filter(|(c, _)| c.meter == Meter::Spend)
                .map(|(c, _)| c.subject.clone())
                .collect();
            if let Some(t) = self.tenancy.as_mut() {
                for subject in spent {
                    t.spenders.entry(subject).or_default().insert(incarnation);
                }
            }
            self.tenant_count_admitted(incarnation, unix_ms, rated);
        }
        self.tenant_claims(&principal);
        match admitted {
            Ok(()) => {
                self.stats.tenant_admitted += 1;
                true
            }
            Err(refusal) => {
                self.stats.tenant_refused += 1;
                if refusal.subject.model().is_some() {
                    self.stats.tenant_model_refused += 1;
                }
                self.stats.failed += 1;
                *self
                    .stats
                    .failures
                    .entry(
                        match refusal.kind {
                            iop_core::tenant::RefusalKind::RateLimited => "rate_limit_exceeded",
                            iop_core::tenant::RefusalKind::InsufficientQuota => {
                                "insufficient_quota"
                            }
                        }
                        .into(),
                    )
                    .or_default() += 1;
                false
            }
        }
    }

    /// R-TEN-1's rates across Edges: count an admitted request against
    /// each of its subjects' requests per minute (`rated`: subject, limit,
    /// admitted on the local share), and check the window's total stays
    /// within the limit + one chunk per Edge process that admitted in it
    /// (+ the local share of each that admitted on it: R-TEN-3's fallback).
    fn tenant_count_admitted(
        &mut self,
        incarnation: u64,
        unix_ms: u64,
        rated: Vec<(Subject, u64, bool)>,
    ) {
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        let minute = unix_ms - unix_ms % iop_core::tenant::MINUTE_MS;
        // Windows over for good are forgotten (the clock only moves on).
        t.admitted
            .retain(|(_, w), _| w + 2 * iop_core::tenant::MINUTE_MS > minute);
        let rule = Tenants::new(t.profile.machine);
        let share = |limit: u64| ((limit as f64 * t.profile.machine.local_share) as u64).max(1);
        let mut fail = Vec::new();
        for (subject, limit, local) in rated {
            let window = t.admitted.entry((subject.clone(), minute)).or_default();
            window.count += 1;
            window.processes.insert(incarnation);
            if local {
                window.local.insert(incarnation);
            }
            let bound = limit
                + window.processes.len() as u64 * rule.chunk(limit)
                + window.local.len() as u64 * share(limit);
            if window.count > bound {
                fail.push(format!(
                    "{subject:?} admitted {} requests in the minute at {minute} against a limit \
                     of {limit} a minute (bound {bound}: {} Edge processes x a chunk of {}, {} \
                     on their local share)",
                    window.count,
                    window.processes.len(),
                    rule.chunk(limit),
                    window.local.len()
                ));
            }
        }
        for detail in fail {
            self.checkers[self.cur].fail("R-TEN-1", detail);
        }
    }

    /// A request asks to reserve for a further attempt that sends its
    /// prompt again (R-TEN-2): the machine's answer as the request's input.
    pub(super) fn tenant_reserve(
        &mut self,
        rid: RequestId,
        extra_input_tokens: u64,
    ) -> RequestInput {
        let now = self.now;
        let unix_ms = self.unix_ms();
        let Some(t) = self.tenancy.as_ref() else {
            return RequestInput::AttemptReserved;
        };
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return RequestInput::AttemptReserved;
        };
        let incarnation = edge.incarnation;
        let Some(et) = edge.tenants.as_mut() else {
            return RequestInput::AttemptReserved;
        };
        // A request held to no tenant has nothing to reserve against.
        let Some(ticket) = et.tickets.get(&rid).cloned() else {
            return RequestInput::AttemptReserved;
        };
        let principal = t.profile.principals[t.profile.keys[ticket.terms.key].1]
            .0
            .clone();
        let reserved =
            et.machine
                .machine_mut()
                .reserve_attempt(now, rid, extra_input_tokens, unix_ms);
        let shadow = et
            .shadows
            .get_mut(&principal)
            .map(|s| s.reserve_attempt(now, rid, extra_input_tokens, unix_ms));
        let mut fail = Vec::new();
        if shadow.as_ref() != Some(&reserved) {
            fail.push((
                "R-TEN-1",
                format!(
                    "request {rid}'s further attempt, principal {principal}: the Edge's machine \
                     answered {reserved:?}, one that saw only this principal's traffic {shadow:?}"
                ),
            ));
        }
        if reserved.is_ok() {
            let attempts = ticket.attempts + 1;
            if let Some(tk) = et.tickets.get_mut(&rid) {
                tk.attempts = attempts;
            }
            let held = et.machine.machine().reservations_of(rid);
            let first = u32::from(ticket.first);
            if held != first + attempts {
                fail.push((
                    "R-TEN-2",
                    format!(
                        "request {rid}'s attempt was answered reserved, but its machine holds \
                         {held} reservations for its admission or adoption ({first}) and \
                         {attempts} further attempts"
                    ),
                ));
            }
        }
        let spent: Vec<Subject> = et
            .machine
            .machine()
            .held_by(rid)
            .iter()
            .filter(|(c, _)| c.meter == Meter::Spend)
            .map(|(c, _)| c.subject.clone())
            .collect();
        if let Some(t) = self.tenancy.as_mut() {
            for subject in spent {
                t.spenders.entry(subject).or_default().insert(incarnation);
            }
        }
        for (rule, detail) in fail {
            self.checkers[self.cur].fail(rule, detail);
        }
        self.tenant_claims(&principal);
        match reserved {
            Ok(()) => {
                self.stats.tenant_attempts_reserved += 1;
                RequestInput::AttemptReserved
            }
            Err(refusal) => {
                if refusal.claim_pending {
                    self.stats.tenant_attempts_waited += 1;
                } else {
                    self.stats.tenant_attempts_refused += 1;
                }
                RequestInput::AttemptRefused(refusal)
            }
        }
    }

    /// A delivery of request `rid`: the usage its answer reports, as the
    /// shell's driver records it (summed over its attempts by the request
    /// machine).
    pub(super) fn tenant_delivery(&mut self, rid: RequestId, delivery: &Delivery) {
        if let Delivery::Event(RunEventKind::TextDelta(text)) = delivery
            && !text.is_empty()
            && let Some(ticket) = self.edges[self.cur]
                .as_mut()
                .and_then(|e| e.tenants.as_mut())
                .and_then(|et| et.tickets.get_mut(&rid))
        {
            ticket.text = true;
        }
        let (usage, completes) = match delivery {
            Delivery::Event(RunEventKind::Usage(u)) => (u, false),
            Delivery::Event(RunEventKind::Completed { usage: Some(u), .. }) => (u, true),
            _ => return,
        };
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return;
        };
        let record = edge.requests.get(&rid).and_then(|r| r.durable.clone());
        let Some(et) = edge.tenants.as_mut() else {
            return;
        };
        match et.tickets.get_mut(&rid) {
            Some(ticket) => {
                ticket.used = Some(TokenUse {
                    input: usage.prompt_tokens,
                    cached_input: usage.cache_read_tokens.unwrap_or(0),
                    cache_write_input: usage.cache_write_tokens.unwrap_or(0),
                    output: usage.completion_tokens,
                });
                if completes && record.is_some() {
                    ticket.completed = Some(*usage);
                }
            }
            // R-TEN-2: a durable answer of a tenant completes on a request
            // held to none (a takeover not charged).
            None if completes
                && record.as_ref().is_some_and(|r| {
                    self.tenancy
                        .as_ref()
                        .is_some_and(|t| t.records.contains_key(r))
                }) =>
            {
                let detail = format!(
                    "request {rid} delivered durable answer {}'s completion (usage {usage:?}) \
                     held to no tenant: it is charged to no key",
                    record.unwrap_or_default()
                );
                self.checkers[self.cur].fail("R-TEN-2", detail);
            }
            None => {}
        }
    }

    /// Durable request `rid`'s record `record` is being created: what a
    /// takeover of it is charged by (R-TEN-2).
    pub(super) fn tenant_record(&mut self, rid: RequestId, record: &str) {
        let Some(ticket) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.tenants.as_mut())
            .and_then(|et| et.tickets.get_mut(&rid))
        else {
            return;
        };
        ticket.record = Some(record.to_owned());
        let terms = ticket.terms.clone();
        if let Some(t) = self.tenancy.as_mut() {
            t.records.insert(record.to_owned(), terms);
        }
    }

    /// A takeover's request `rid` on record `record` (R-TEN-2, R-TAKE-1):
    /// held to the record's key and principal with its terms; `adopted`:
    /// it adopts the parked run, reserved at once on credit.
    pub(super) fn tenant_take_over(&mut self, rid: RequestId, meta: &RecordMeta, adopted: bool) {
        let (record, epoch) = (meta.id.as_str(), meta.epoch);
        let now = self.now;
        let unix_ms = self.unix_ms();
        let Some(t) = self.tenancy.as_ref() else {
            return;
        };
        let Some(terms) = t.records.get(record).cloned() else {
            return;
        };
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return;
        };
        let incarnation = edge.incarnation;
        let Some(et) = edge.tenants.as_mut() else {
            return;
        };
        let (key_id, p, key_limits) = &t.profile.keys[terms.key];
        let (principal, principal_limits) = &t.profile.principals[*p];
        let request = AdmitRequest {
            ticket: rid,
            key: key_id.clone(),
            principal: principal.clone(),
            key_limits: key_limits.clone(),
            principal_limits: principal_limits.clone(),
            price: Some(t.profile.price),
            prompt_tokens_max: iop_core::tenant::prompt_tokens_max(terms.prompt_bytes),
            output_tokens_max: t.profile.output_tokens_max,
            unix_ms,
            model: terms.model.clone(),
            durable: true,
            background: false,
            key_held: Held::default(),
            principal_held: Held::default(),
        };
        let shadow = et.shadows.get_mut(principal);
        if adopted {
            et.machine.machine_mut().admit_adopted(now, &request);
            if let Some(s) = shadow {
                s.admit_adopted(now, &request);
            }
            self.stats.tenant_adoptions_held += 1;
        } else {
            et.machine.machine_mut().admit_taken_over(now, &request);
            if let Some(s) = shadow {
                s.admit_taken_over(now, &request);
            }
            self.stats.tenant_continuations_held += 1;
        }
        et.tickets.insert(
            rid,
            Ticket {
                terms,
                used: None,
                first: adopted,
                attempts: 0,
                // An adoption is a call of its own, made by its Edge.
                calls: u32::from(adopted),
                local: Vec::new(),
                record: Some(record.to_owned()),
                completed: None,
                unmetered: Unmetered::default(),
                text: false,
                takeover: Some((adopted, epoch)),
                taken_over: true,
            },
        );
        let spent: Vec<Subject> = et
            .machine
            .machine()
            .held_by(rid)
            .iter()
            .filter(|(c, _)| c.meter == Meter::Spend)
            .map(|(c, _)| c.subject.clone())
            .collect();
        let principal = principal.clone();
        if let Some(t) = self.tenancy.as_mut() {
            for subject in spent {
                t.spenders.entry(subject).or_default().insert(incarnation);
            }
        }
        self.tenant_claims(&principal);
    }

    /// Request `rid` opens the adoption of its parked run: R-TEN-2's check
    /// that its adoption is covered by a reservation (the adopted run is an
    /// attempt that its Edge charges).
    pub(super) fn tenant_adoption_call(&mut self, rid: RequestId) {
        let Some(et) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.tenants.as_mut())
        else {
            return;
        };
        let Some(ticket) = et.tickets.get(&rid) else {
            return;
        };
        let held = et.machine.machine().reservations_of(rid);
        if held < ticket.calls {
            let detail = format!(
                "request {rid} adopts a parked run with {held} reservations held for {} calls \
                 (the adoption's own included)",
                ticket.calls
            );
            self.checkers[self.cur].fail("R-TEN-2", detail);
        }
    }

    /// Request `rid` ended: the tokens no usage report covers, as its
    /// machine estimated them (R-TEN-2).
    pub(super) fn tenant_unmetered(&mut self, rid: RequestId, unmetered: Unmetered) {
        if let Some(ticket) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.tenants.as_mut())
            .and_then(|et| et.tickets.get_mut(&rid))
        {
            ticket.unmetered = unmetered;
        }
    }

    /// The prompt's tokens of request `rid` as its reservation estimated
    /// them (its `RequestSpec::prompt_tokens`, R-TEN-2); 0 for a request
    /// held to no tenant.
    pub(super) fn tenant_prompt_tokens(&self, rid: RequestId) -> u64 {
        self.edges[self.cur]
            .as_ref()
            .and_then(|e| e.tenants.as_ref())
            .and_then(|et| et.tickets.get(&rid))
            .map_or(0, |t| {
                iop_core::tenant::prompt_tokens_max(t.terms.prompt_bytes)
            })
    }

    /// The prompt's tokens of durable record `record`'s request, as a
    /// takeover's reservation estimates them from the stored request.
    pub(super) fn tenant_record_prompt_tokens(&self, record: &str) -> u64 {
        self.tenancy
            .as_ref()
            .and_then(|t| t.records.get(record))
            .map_or(0, |terms| {
                iop_core::tenant::prompt_tokens_max(terms.prompt_bytes)
            })
    }

    /// What record `record`'s journal holds of its answer, as the checks
    /// read it: its text, whether a usage report was journaled, its
    /// epoch and its terminal's status.
    fn journaled_answer(&self, record: &str) -> Option<(String, bool, u64, Option<RecordStatus>)> {
        let stored = self.journal.record(record)?;
        let mut text = String::new();
        let mut usage = false;
        for event in &stored.events {
            let Some(entry) = iop_core::edge::durable::decode_entry(&event.payload) else {
                continue;
            };
            match entry.delivery {
                Delivery::Event(RunEventKind::TextDelta(t)) => text.push_str(&t),
                Delivery::Event(RunEventKind::Usage(_))
                | Delivery::Event(RunEventKind::Completed { usage: Some(_), .. }) => usage = true,
                _ => {}
            }
        }
        let status = stored.meta.terminal.as_ref().map(|t| t.status);
        Some((text, usage, stored.meta.epoch, status))
    }

    /// The custody charges durable answer `meta.id`, which it ended
    /// `incomplete` without running it, what its journal holds (R-TEN-2):
    /// as the shell's `stored::charge_ended`, on the record's key and
    /// principal, its prompt estimated from the stored request.
    pub(super) fn tenant_charge_ended(&mut self, meta: &RecordMeta, used: &JournaledUse) {
        let now = self.now;
        let unix_ms = self.unix_ms();
        let prompt_tokens = self.tenant_record_prompt_tokens(&meta.id);
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        let Some(terms) = t.records.get(&meta.id).cloned() else {
            return;
        };
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return;
        };
        let incarnation = edge.incarnation;
        let Some(et) = edge.tenants.as_mut() else {
            return;
        };
        let Some(charged) = used.charged(prompt_tokens) else {
            return;
        };
        let (key_id, p, key_limits) = &t.profile.keys[terms.key];
        let (principal, principal_limits) = &t.profile.principals[*p];
        let request = AdmitRequest {
            ticket: u64::MAX,
            key: key_id.clone(),
            principal: principal.clone(),
            key_limits: key_limits.clone(),
            principal_limits: principal_limits.clone(),
            price: Some(t.profile.price),
            prompt_tokens_max: prompt_tokens,
            output_tokens_max: t.profile.output_tokens_max,
            unix_ms,
            model: terms.model.clone(),
            durable: true,
            background: false,
            key_held: Held::default(),
            principal_held: Held::default(),
        };
        let (row, totals) = et
            .machine
            .machine_mut()
            .charge_ended(now, &request, charged);
        let shadow = et
            .shadows
            .get_mut(principal)
            .map(|s| s.charge_ended(now, &request, charged));
        let mut fail = Vec::new();
        if shadow.as_ref() != Some(&(row.clone(), totals)) {
            fail.push((
                "R-TEN-1",
                format!(
                    "record {}'s charge, principal {principal}: {:?} on the Edge's machine, \
                     {shadow:?} on one that saw only this principal",
                    meta.id,
                    (&row, totals)
                ),
            ));
        }
        if row.key != *key_id {
            fail.push((
                "R-TEN-2",
                format!(
                    "record {} was charged on key {}, not its own",
                    meta.id, row.key
                ),
            ));
        }
        for subject in [
            Subject::Key(key_id.clone()),
            Subject::Principal(principal.clone()),
        ] {
            *t.recorded.entry(subject.clone()).or_default() += totals.spend_micros;
            if charged.total() > 0 {
                t.spenders.entry(subject).or_default().insert(incarnation);
            }
        }
        if used.usage.is_some() && t.usage_settled.contains(&meta.id) {
            fail.push((
                "R-TEN-2",
                format!(
                    "durable answer {}'s reported usage was charged by its request's \
                     settlement and again by the takeover that ended it ({used:?})",
                    meta.id
                ),
            ));
        }
        if used.usage.is_some() {
            t.usage_ended.insert(meta.id.clone());
        }
        *t.ended_charged.entry(meta.id.clone()).or_default() += 1;
        if t.ended_charged[&meta.id] > 1 {
            fail.push((
                "R-TEN-2",
                format!(
                    "durable answer {} ended by a takeover was charged {} times",
                    meta.id, t.ended_charged[&meta.id]
                ),
            ));
        }
        t.ended_totals.insert(meta.id.clone(), totals);
        let principal = principal.clone();
        et.machine.handle_timeout(now);
        for s in et.shadows.values_mut() {
            s.handle_timeout(now);
        }
        self.stats.tenant_unmetered_tokens += charged.total();
        for (rule, detail) in fail {
            self.checkers[self.cur].fail(rule, detail);
        }
        self.tenant_claims(&principal);
    }

    /// The custody ended durable answer `record` `incomplete` without
    /// running it (R-TEN-2): if its journal holds text no usage report
    /// covers, that text's estimate and the prompt were charged, on its key,
    /// by this custody (its charge comes before the end).
    pub(super) fn tenant_check_ended(&mut self, record: &str) {
        let Some(t) = self.tenancy.as_ref() else {
            return;
        };
        let Some(terms) = t.records.get(record).cloned() else {
            return;
        };
        let Some((text, usage, _, _)) = self.journaled_answer(record) else {
            return;
        };
        if text.is_empty() || usage {
            return;
        }
        let want_output = iop_core::edge::prompt_estimate::text_tokens(&text);
        let want_input = iop_core::tenant::prompt_tokens_max(terms.prompt_bytes);
        let got = t.ended_totals.get(record).copied();
        let short =
            got.is_none_or(|g| g.output_tokens < want_output || g.input_tokens < want_input);
        if short {
            let detail = format!(
                "durable answer {record} ended incomplete by a takeover after producing text \
                 ({want_output} tokens estimated, prompt {want_input}) was charged {got:?} on \
                 its key"
            );
            self.checkers[self.cur].fail("R-TEN-2", detail);
        }
    }

    /// Request `rid` sends its prompt to a provider: what the run carries
    /// (its prompt's bytes and most output tokens), and R-TEN-2's check
    /// that the call is covered by a reservation of its own. `None`: the
    /// request is held to no tenant's limits.
    pub(super) fn tenant_call(&mut self, rid: RequestId) -> Option<(u64, u64)> {
        let output = self.tenancy.as_ref()?.profile.output_tokens_max;
        let et = self.edges[self.cur].as_mut()?.tenants.as_mut()?;
        let ticket = et.tickets.get_mut(&rid)?;
        ticket.calls += 1;
        let (calls, prompt) = (ticket.calls, ticket.terms.prompt_bytes);
        let held = et.machine.machine().reservations_of(rid);
        if held < calls {
            let detail = format!(
                "request {rid} sends its prompt for the {calls}th time with {held} \
                 reservations held"
            );
            self.checkers[self.cur].fail("R-TEN-2", detail);
        }
        Some((prompt, output))
    }

    /// Request `rid` ended: settle it with the usage its answer reported,
    /// or release it (it reported none), and check the settlement.
    /// The answer of request `rid` is charged by the Edge that took its
    /// record over (`Request::answer_charged_elsewhere`): its settlement
    /// charges nothing the answer reported, as the shell's does.
    pub(super) fn tenant_forget_reported(&mut self, rid: RequestId) {
        if let Some(ticket) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.tenants.as_mut())
            .and_then(|et| et.tickets.get_mut(&rid))
        {
            ticket.used = None;
            ticket.completed = None;
        }
    }

    pub(super) fn tenant_settle(&mut self, rid: RequestId) {
        let now = self.now;
        // R-TEN-2: what the journal holds of a lost adoption's answer (on
        // a route that does not continue: a continuation would be a
        // further attempt), read before the tenants are borrowed.
        let adopted_answer = self.edges[self.cur]
            .as_ref()
            .and_then(|e| e.tenants.as_ref())
            .and_then(|et| et.tickets.get(&rid))
            .and_then(|ticket| match (&ticket.record, ticket.takeover) {
                (Some(record), Some((true, epoch))) if ticket.used.is_none() => {
                    Some((record.clone(), epoch))
                }
                _ => None,
            })
            .filter(|(record, _)| !self.route_continues(record))
            .and_then(|(record, epoch)| {
                self.journaled_answer(&record)
                    .filter(|(_, usage, at, status)| !usage && *at == epoch && status.is_some())
                    .map(|(text, ..)| (record, text))
            });
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return;
        };
        let Some(et) = edge.tenants.as_mut() else {
            return;
        };
        let Some(ticket) = et.tickets.remove(&rid) else {
            return;
        };
        let principal = t.profile.principals[t.profile.keys[ticket.terms.key].1]
            .0
            .clone();
        let held: Vec<(CounterKey, u64)> = et.machine.machine().held_by(rid).to_vec();
        let counters: BTreeSet<&CounterKey> = held.iter().map(|(c, _)| c).collect();
        let before: BTreeMap<&CounterKey, u64> = counters
            .iter()
            .map(|c| (*c, et.machine.machine().used(c).unwrap_or(0)))
            .collect();
        // As the shell's hold: the reported usage and the estimate of what
        // no report covers.
        let metered = TokenUse::settled(ticket.used, ticket.unmetered);
        self.stats.tenant_unmetered_tokens += ticket.unmetered.input + ticket.unmetered.output;
        let used = metered.unwrap_or_default();
        let settled = match metered {
            Some(used) => et.machine.machine_mut().settle(now, rid, used),
            None => et.machine.machine_mut().release(now, rid),
        };
        let shadow = et.shadows.get_mut(&principal).map(|s| match metered {
            Some(used) => s.settle(now, rid, used),
            None => s.release(now, rid),
        });
        let mut fail = Vec::new();
        if shadow.as_ref() != Some(&settled) {
            fail.push((
                "R-TEN-1",
                format!(
                    "request {rid}'s settlement, principal {principal}: {settled:?} on the \
                     Edge's machine, {shadow:?} on one that saw only this principal"
                ),
            ));
        }
        // Every reservation once: given back whole, the use charged once.
        let spend = used.cost(&t.profile.price);
        let mut moved: BTreeMap<(&Subject, Meter), i128> = BTreeMap::new();
        for c in &counters {
            let after = et.machine.machine().used(c).unwrap_or(0);
            *moved.entry((&c.subject, c.meter)).or_default() +=
                i128::from(after) - i128::from(before[*c]);
        }
        let mut reserved: BTreeMap<(&Subject, Meter), i128> = BTreeMap::new();
        for (c, amount) in &held {
            *reserved.entry((&c.subject, c.meter)).or_default() += i128::from(*amount);
        }
        for ((subject, meter), reserved) in &reserved {
            let charged = match meter {
                Meter::Requests => *reserved,
                Meter::Tokens => i128::from(used.total()),
                Meter::Spend => i128::from(spend),
                Meter::JournalBytes | Meter::Background | Meter::Slots => continue,
            };
            let expect = charged - reserved;
            let got = moved.get(&(*subject, *meter)).copied().unwrap_or(0);
            if got != expect {
                fail.push((
                    "R-TEN-2",
                    format!(
                        "request {rid}'s settlement moved {subject:?}'s {} by {got}, not by its \
                         use {charged} less its reservations {reserved}: a reservation given \
                         back other than once",
                        meter.as_str()
                    ),
                ));
            }
        }
        if et.machine.machine().reservations_of(rid) != 0 {
            fail.push((
                "R-TEN-2",
                format!("request {rid} still holds a reservation after its settlement"),
            ));
        }
        match &settled {
            None => fail.push((
                "R-TEN-2",
                format!("request {rid} was admitted but its settlement found no reservation"),
            )),
            Some((row, totals)) => {
                // R-TEN-2: a request that delivered text with no usage
                // report is charged its prompt too (an ephemeral one: a
                // durable one whose record was taken charges nothing).
                let prompt = iop_core::tenant::prompt_tokens_max(ticket.terms.prompt_bytes);
                if ticket.record.is_none()
                    && ticket.used.is_none()
                    && ticket.text
                    && totals.input_tokens < prompt
                {
                    fail.push((
                        "R-TEN-2",
                        format!(
                            "request {rid} delivered text with no usage report and was charged \
                             {} input tokens, less than its prompt's {prompt}",
                            totals.input_tokens
                        ),
                    ));
                }
                // A lost adoption on a route that does not continue is
                // charged the whole text its journal holds.
                if let Some((record, text)) = &adopted_answer {
                    let want = iop_core::edge::prompt_estimate::text_tokens(text);
                    if totals.output_tokens < want {
                        fail.push((
                            "R-TEN-2",
                            format!(
                                "request {rid} ended adopted answer {record} with \
                                 {want} tokens of text estimated in its journal and was charged \
                                 {} output tokens",
                                totals.output_tokens
                            ),
                        ));
                    }
                }
                let key_subject = Subject::Key(t.profile.keys[ticket.terms.key].0.clone());
                for subject in [key_subject, Subject::Principal(principal.clone())] {
                    *t.recorded.entry(subject).or_default() += totals.spend_micros;
                }
                if let (Some(record), Some(_)) = (&ticket.record, ticket.used) {
                    t.usage_settled.insert(record.clone());
                    if t.usage_ended.contains(record) && ticket.takeover.is_none() {
                        fail.push((
                            "R-TEN-2",
                            format!(
                                "request {rid} settled the usage of durable answer {record} \
                                 that a takeover had ended and charged already"
                            ),
                        ));
                    }
                }
                // Every durable answer's usage charged once, to its key.
                if let (Some(record), Some(reported)) = (&ticket.record, ticket.completed) {
                    let charged = t.completions_charged.entry(record.clone()).or_default();
                    *charged += 1;
                    if *charged > 1 {
                        fail.push((
                            "R-TEN-2",
                            format!(
                                "durable answer {record}'s completion was charged by {charged} \
                                 settlements over the Edges (request {rid}'s the last)"
                            ),
                        ));
                    }
                    if totals.input_tokens < reported.prompt_tokens
                        || totals.output_tokens < reported.completion_tokens
                        || row.key != t.profile.keys[ticket.terms.key].0
                    {
                        fail.push((
                            "R-TEN-2",
                            format!(
                                "request {rid} settled durable answer {record} with {totals:?} \
                                 on key {}, less than its reported usage {reported:?}",
                                row.key
                            ),
                        ));
                    }
                }
            }
        }
        // As the shell does after a settlement.
        et.machine.handle_timeout(now);
        for s in et.shadows.values_mut() {
            s.handle_timeout(now);
        }
        for (rule, detail) in fail {
            self.checkers[self.cur].fail(rule, detail);
        }
        self.stats.tenant_settled += 1;
        self.tenant_claims(&principal);
    }

    /// A durable request whose record was not created ends before it
    /// started: it is released.
    pub(super) fn tenant_release_unstarted(&mut self, rid: RequestId) {
        self.tenant_settle(rid);
    }

    /// Carry the claims of the current Edge's machine to the store, after
    /// an operation of `principal`: each must be one of that principal's
    /// counters, and exactly those its shadow asks for (R-TEN-1).
    fn tenant_claims(&mut self, principal: &str) {
        let now = self.now;
        let Some(t) = self.tenancy.as_ref() else {
            return;
        };
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return;
        };
        let incarnation = edge.incarnation;
        let Some(et) = edge.tenants.as_mut() else {
            return;
        };
        let claims: Vec<TenantsOutput> = et.machine.drain_all(now);
        // Principal by principal, the machine asks exactly what the
        // principal's shadow asks; only the operating principal's claims
        // follow its operation (a settlement's timers may renew another
        // principal's leases on slots, as its shadow does).
        let mut fail = Vec::new();
        for (p, shadow) in et.shadows.iter_mut() {
            let theirs: Vec<TenantsOutput> = std::iter::from_fn(|| shadow.poll_output()).collect();
            let ours: Vec<&TenantsOutput> = claims
                .iter()
                .filter(|out| principal_of(&t.profile, &out.counter().subject) == p)
                .collect();
            let stray = p != principal
                && ours
                    .iter()
                    .any(|out| matches!(out, TenantsOutput::Claim { .. }));
            if stray || ours.len() != theirs.len() || ours.iter().zip(&theirs).any(|(a, b)| *a != b)
            {
                fail.push(format!(
                    "after principal {principal}'s operation the Edge's machine asks {ours:?} of \
                     principal {p}'s counters, one that saw only {p}'s traffic {theirs:?}"
                ));
            }
        }
        let unknown = claims.iter().any(|out| {
            !et.shadows
                .contains_key(principal_of(&t.profile, &out.counter().subject))
        });
        if unknown {
            fail.push(format!(
                "the Edge's machine asks of no principal's counters: {claims:?}"
            ));
        }
        for detail in fail {
            self.checkers[self.cur].fail("R-TEN-1", detail);
        }
        self.tenant_carry(incarnation, claims);
    }

    /// Carry an Edge process's outputs to the store.
    fn tenant_carry(&mut self, incarnation: u64, outputs: Vec<TenantsOutput>) {
        for out in outputs {
            self.stats.tenant_claims += 1;
            let event = match out {
                TenantsOutput::Claim {
                    counter,
                    amount,
                    limit,
                } => TenantEvent::Store(ClaimOp {
                    incarnation,
                    counter,
                    amount,
                    limit,
                    tries: 0,
                    read: None,
                }),
                TenantsOutput::HoldSlots {
                    counter,
                    want,
                    limit,
                    lease_ms,
                } => TenantEvent::Slots {
                    incarnation,
                    counter,
                    want,
                    limit,
                    lease_ms,
                },
                TenantsOutput::GiveBack { counter, amount } => TenantEvent::GiveBack {
                    incarnation,
                    counter,
                    amount,
                    tries: 1,
                },
            };
            self.tenant_hop(event);
        }
    }

    /// The tenants' timers of every live Edge process (leases on slots to
    /// renew, windows to forget), as the shell's periodic tick does; each
    /// machine's outputs and its shadows' must be the same, principal by
    /// principal (R-TEN-1).
    pub(super) fn tenant_timers(&mut self) {
        let now = self.now;
        for slot in 0..self.edges.len() {
            let Some(edge) = self.edges[slot].as_mut() else {
                continue;
            };
            let incarnation = edge.incarnation;
            let Some(et) = edge.tenants.as_mut() else {
                continue;
            };
            if et.machine.machine().poll_timeout().is_none_or(|t| t > now) {
                continue;
            }
            et.machine.handle_timeout(now);
            let mut outputs: Vec<TenantsOutput> = et.machine.drain_all(now);
            let mut shadow: Vec<TenantsOutput> = Vec::new();
            for s in et.shadows.values_mut() {
                s.handle_timeout(now);
                shadow.extend(std::iter::from_fn(|| s.poll_output()));
            }
            let key = |o: &TenantsOutput| format!("{o:?}");
            outputs.sort_by_key(key);
            shadow.sort_by_key(key);
            if outputs != shadow {
                let detail = format!(
                    "at a timer the Edge's machine asks {outputs:?}, the machines that saw one \
                     principal each {shadow:?}"
                );
                self.checkers[slot].fail("R-TEN-1", detail);
            }
            self.tenant_carry(incarnation, outputs);
        }
    }

    /// Schedule `event` one hop (a seeded latency) from now.
    fn tenant_hop(&mut self, event: TenantEvent) {
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let latency = Duration::from_micros(t.rng.range(
            us(t.profile.store_latency_min),
            us(t.profile.store_latency_max),
        ));
        self.schedule(self.now + latency, Event::Tenant(Box::new(event)));
    }

    /// A step of the store's traffic.
    pub(super) fn tenant_event(&mut self, event: TenantEvent) {
        match event {
            TenantEvent::Store(op) => self.tenant_store_step(op),
            TenantEvent::Answer {
                incarnation,
                counter,
                granted,
            } => self.tenant_answer(incarnation, counter, granted),
            TenantEvent::Slots {
                incarnation,
                counter,
                want,
                limit,
                lease_ms,
            } => self.tenant_slots_step(incarnation, counter, want, limit, lease_ms),
            TenantEvent::SlotsAnswer {
                incarnation,
                counter,
                held,
            } => self.tenant_answer_input(
                incarnation,
                counter.clone(),
                TenantsInput::SlotsHeld { counter, held },
            ),
            TenantEvent::GiveBack {
                incarnation,
                counter,
                amount,
                tries,
            } => self.tenant_give_back_step(incarnation, counter, amount, tries),
        }
    }

    /// The Edge process of the current slot stops gracefully, if the seed
    /// says so (about half the restarts of a world with tenants), just
    /// before it ends: its machine hands back what it holds (R-TEN-3).
    /// Its shadows, asked the same, give back the same, principal by
    /// principal (R-TEN-1).
    pub(super) fn tenant_graceful_stop(&mut self) {
        let now = self.now;
        let unix_ms = self.unix_ms();
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        if !t.rng.chance(crate::config::PPM / 2) {
            return;
        }
        let Some(edge) = self.edges[self.cur].as_mut() else {
            return;
        };
        let incarnation = edge.incarnation;
        let Some(et) = edge.tenants.as_mut() else {
            return;
        };
        self.stats.tenant_graceful_stops += 1;
        et.machine.machine_mut().hand_back(unix_ms);
        let mut outputs: Vec<TenantsOutput> = et.machine.drain_all(now);
        let mut shadow: Vec<TenantsOutput> = Vec::new();
        for s in et.shadows.values_mut() {
            s.hand_back(unix_ms);
            shadow.extend(std::iter::from_fn(|| s.poll_output()));
        }
        let key = |o: &TenantsOutput| format!("{o:?}");
        outputs.sort_by_key(key);
        shadow.sort_by_key(key);
        if outputs != shadow {
            let detail = format!(
                "stopping, the Edge's machine gives back {outputs:?}, the machines that saw one \
                 principal each {shadow:?}"
            );
            self.checkers[self.cur].fail("R-TEN-1", detail);
        }
        self.tenant_carry(incarnation, outputs);
    }

    /// A stopping Edge process's give-back reaches the store: one
    /// compare-and-set. It fails while the store is down (or by a fault),
    /// and its answer may be lost; either way the stopping Edge sends it
    /// again (its machine's retry), [`GIVE_BACK_RETRY_MS`] later, at most
    /// [`MAX_GIVE_BACK_ASKS`] times in all. The answer itself reaches no
    /// machine: the process ends with its stop.
    fn tenant_give_back_step(
        &mut self,
        incarnation: u64,
        counter: CounterKey,
        amount: u64,
        tries: u32,
    ) {
        let faults = self.faults_on();
        let now = self.now;
        let unix_ms = self.unix_ms();
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        let failed = !t.store.is_up(now) || (faults && t.rng.chance(t.profile.store_fail_ppm));
        let answered = if failed {
            None
        } else {
            let outcome = t
                .store
                .give_back(&counter, &holder(incarnation), amount, unix_ms);
            if let GiveBackOutcome::Freed(n) = outcome {
                self.stats.tenant_given_back += n;
            }
            let lost = faults && t.rng.chance(t.profile.store_answer_lost_ppm);
            (!lost).then_some(outcome)
        };
        if answered.is_none() {
            self.stats.tenant_store_failures += 1;
            if tries < MAX_GIVE_BACK_ASKS {
                let at = now + Duration::from_millis(GIVE_BACK_RETRY_MS);
                self.schedule(
                    at,
                    super::Event::Tenant(Box::new(TenantEvent::GiveBack {
                        incarnation,
                        counter,
                        amount,
                        tries: tries + 1,
                    })),
                );
            }
        }
    }

    /// An ask for slots reaches the store: one compare-and-set on the
    /// gauge's record (it may fail, or its answer be lost, as a claim's).
    fn tenant_slots_step(
        &mut self,
        incarnation: u64,
        counter: CounterKey,
        want: u64,
        limit: u64,
        lease_ms: u64,
    ) {
        let faults = self.faults_on();
        let now = self.now;
        let unix_ms = self.unix_ms();
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        let held = if !t.store.is_up(now) || (faults && t.rng.chance(t.profile.store_fail_ppm)) {
            self.stats.tenant_store_failures += 1;
            None
        } else {
            let held = t.store.hold_slots(&SlotAsk {
                counter: counter.clone(),
                holder: holder(incarnation),
                want,
                limit,
                now_unix_ms: unix_ms,
                lease_ms,
            });
            let lost = faults && t.rng.chance(t.profile.store_answer_lost_ppm);
            if lost {
                self.stats.tenant_store_failures += 1;
            }
            (!lost).then_some(held)
        };
        self.tenant_hop(TenantEvent::SlotsAnswer {
            incarnation,
            counter,
            held,
        });
    }

    /// A claim's hop reaches the store: read, or compare-and-set.
    fn tenant_store_step(&mut self, mut op: ClaimOp) {
        let faults = self.faults_on();
        let now = self.now;
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        let answer = |op: &ClaimOp, granted| TenantEvent::Answer {
            incarnation: op.incarnation,
            counter: op.counter.clone(),
            granted,
        };
        if !t.store.is_up(now) || (faults && t.rng.chance(t.profile.store_fail_ppm)) {
            self.stats.tenant_store_failures += 1;
            let event = answer(&op, None);
            self.tenant_hop(event);
            return;
        }
        match op.read {
            None => {
                op.read = Some(t.store.read(&op.counter));
                self.tenant_hop(TenantEvent::Store(op));
            }
            Some((claimed, revision)) => {
                match t
                    .store
                    .compare_and_claim(&op.counter, revision, claimed, op.amount, op.limit)
                {
                    Some(granted) => {
                        let lost = faults && t.rng.chance(t.profile.store_answer_lost_ppm);
                        if lost {
                            self.stats.tenant_store_failures += 1;
                        }
                        let event = answer(&op, (!lost).then_some(granted));
                        self.tenant_hop(event);
                    }
                    None if op.tries + 1 >= MAX_CLAIM_TRIES => {
                        let event = answer(&op, None);
                        self.tenant_hop(event);
                    }
                    None => {
                        op.tries += 1;
                        op.read = None;
                        self.tenant_store_step(op);
                    }
                }
            }
        }
    }

    /// The store's answer reaches the Edge process that asked (if it
    /// lives): its machine and the claim's principal's shadow hear it.
    fn tenant_answer(&mut self, incarnation: u64, counter: CounterKey, granted: Option<u64>) {
        let input = TenantsInput::Claimed {
            counter: counter.clone(),
            granted,
        };
        self.tenant_answer_input(incarnation, counter, input);
    }

    /// A store's answer about `counter` reaches the Edge process that
    /// asked (if it lives): its machine and the counter's principal's
    /// shadow hear it.
    fn tenant_answer_input(&mut self, incarnation: u64, counter: CounterKey, input: TenantsInput) {
        let now = self.now;
        let Some(t) = self.tenancy.as_ref() else {
            return;
        };
        let principal = principal_of(&t.profile, &counter.subject).to_owned();
        let Some(edge) = self.edges[self.cur]
            .as_mut()
            .filter(|e| e.incarnation == incarnation)
        else {
            return;
        };
        let Some(et) = edge.tenants.as_mut() else {
            return;
        };
        et.machine.handle_input(now, input.clone());
        if let Some(s) = et.shadows.get_mut(&principal) {
            s.handle_input(now, input);
        }
        self.tenant_claims(&principal);
    }

    /// While faults are on: the store may go down for a while.
    pub(super) fn tenant_fault_tick(&mut self) {
        let now = self.now;
        let Some(t) = self.tenancy.as_mut() else {
            return;
        };
        if t.rng.chance(t.profile.store_outage_ppm) {
            self.stats.tenant_store_outages += 1;
            let until = now
                + t.rng
                    .millis(10, super::duration_ms(t.profile.store_outage_max));
            t.store.down_until(until);
        }
    }

    /// The faults stop: the store answers.
    pub(super) fn tenant_stop_faults(&mut self) {
        if let Some(t) = self.tenancy.as_mut() {
            t.store.heal();
        }
    }

    /// R-TEN-2's bound and R-TEN-3's store, after every step.
    pub(super) fn check_tenants(&mut self) {
        let Some(t) = self.tenancy.as_ref() else {
            return;
        };
        if let Some((counter, claimed, limit)) = t.store.over_limit() {
            let detail = format!("{counter:?} claimed {claimed} of a limit of {limit}");
            self.checkers[self.cur].fail("R-TEN-3", detail);
        }
        let unix_ms = self.unix_ms();
        if let Some((counter, held, limit)) = t.store.slots_over_limit(unix_ms) {
            let detail =
                format!("{counter:?}: its holders hold {held} slots of a limit of {limit}");
            self.checkers[self.cur].fail("R-TEN-3", detail);
        }
        // R-TEN-1: requests in flight per subject with a concurrency limit,
        // over every live Edge process, within the limit + one chunk per
        // process (+ its local share where it admits on it).
        let rule = Tenants::new(t.profile.machine);
        let share = |limit: u64| ((limit as f64 * t.profile.machine.local_share) as u64).max(1);
        let mut concurrent: Vec<(Subject, u64)> = Vec::new();
        for (p, limits) in &t.profile.principals {
            concurrent.extend(
                limits
                    .concurrent_requests
                    .map(|l| (Subject::Principal(p.clone()), l)),
            );
            for (model, m) in &limits.per_model {
                concurrent.extend(m.concurrent_requests.map(|l| {
                    (
                        Subject::PrincipalModel {
                            principal: p.clone(),
                            model: model.clone(),
                        },
                        l,
                    )
                }));
            }
        }
        for (k, _, limits) in &t.profile.keys {
            concurrent.extend(
                limits
                    .concurrent_requests
                    .map(|l| (Subject::Key(k.clone()), l)),
            );
            for (model, m) in &limits.per_model {
                concurrent.extend(m.concurrent_requests.map(|l| {
                    (
                        Subject::KeyModel {
                            key: k.clone(),
                            model: model.clone(),
                        },
                        l,
                    )
                }));
            }
        }
        let mut over = Vec::new();
        for (subject, limit) in concurrent {
            let (mut in_flight, mut bound) = (0, limit);
            for et in self
                .edges
                .iter()
                .flatten()
                .filter_map(|e| e.tenants.as_ref())
            {
                let n = et.machine.machine().in_flight(&subject);
                if n == 0 {
                    continue;
                }
                in_flight += n;
                bound += rule.chunk(limit);
                // A takeover's request was admitted within the limit by an
                // Edge that is gone and is not refused again: it counts
                // here without a slot of its own (`admit_taken_over`), the
                // overshoot at most what the gone Edges had in flight.
                bound += et
                    .tickets
                    .values()
                    .filter(|tk| tk.taken_over && t.ticket_is_of(tk, &subject))
                    .count() as u64;
                let local = et.machine.machine().store_down_for(&subject)
                    || et.tickets.values().any(|tk| tk.local.contains(&subject));
                if local {
                    bound += share(limit);
                }
            }
            if in_flight > bound {
                over.push(format!(
                    "{subject:?} has {in_flight} requests in flight over the Edges against a \
                     limit of {limit} (bound {bound})"
                ));
            }
        }
        for detail in over {
            self.checkers[self.cur].fail("R-TEN-1", detail);
        }
        let Some(t) = self.tenancy.as_ref() else {
            return;
        };
        let chunk = Tenants::new(t.profile.machine);
        let budgets = t
            .profile
            .principals
            .iter()
            .map(|(p, l)| (Subject::Principal(p.clone()), l))
            .chain(
                t.profile
                    .keys
                    .iter()
                    .map(|(k, _, l)| (Subject::Key(k.clone()), l)),
            );
        for (subject, limits) in budgets {
            let Some(budget) = limits.budget else {
                continue;
            };
            let recorded = t.recorded.get(&subject).copied().unwrap_or(0);
            let processes = t.spenders.get(&subject).map_or(0, BTreeSet::len) as u64;
            let bound = budget.limit_micros + processes * chunk.chunk(budget.limit_micros);
            if recorded > bound {
                let detail = format!(
                    "{subject:?} recorded a spend of {recorded} against a budget of {} (bound \
                     {bound}: {processes} Edge processes x a chunk of {})",
                    budget.limit_micros,
                    chunk.chunk(budget.limit_micros)
                );
                self.checkers[self.cur].fail("R-TEN-2", detail);
            }
        }
    }

    /// The Edge process's admitted requests not yet settled (the drain
    /// waits for none; a settled world has none).
    pub(super) fn tenant_open_tickets(&self) -> usize {
        self.edges
            .iter()
            .flatten()
            .filter_map(|e| e.tenants.as_ref())
            .map(|et| et.tickets.len())
            .sum()
    }
}
