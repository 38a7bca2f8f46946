//! Tenants' limits, budgets and usage at the Edge (SPEC §9): this module
//! drives [`iop_core::tenant::Tenants`], which decides every admission,
//! reservation and settlement (R-TEN-1, R-TEN-2, R-TEN-3). It asks the
//! machine at admission (a direct answer: nothing waits on a store),
//! carries its claims to the deployment's [`TenantStore`] off the request's
//! path, settles each request when its [`TenantHold`] is dropped, with the
//! usage its driver saw, and writes the settled usage to the store in
//! batches (R-TEN-5).
//!
//! The store is the journal's deployment store: the embedded store for
//! one Edge, NATS JetStream for several, where every Edge claims from the
//! same counters. A claim the store does not answer within
//! [`CLAIM_TIMEOUT`] counts as the store being unreachable: budgets fail
//! closed and rates fall back to a local share (the machine's rule), and
//! `/status` says so.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use iop_core::tenant::slots::SlotAsk;
use iop_core::tenant::usage::{UsageBook, UsageKey, UsageTotals};
use iop_core::tenant::{
    Admission, AdmitRequest, AttemptRefusal, Held, Limits, Meter, Price, Refusal, RefusalKind,
    Subject, Tenants, TenantsConfig, TenantsInput, TenantsOutput, TokenUse, Unmetered,
};
use iop_store::TenantStore;
use iop_trace::{Driven, MachineKind, Tap, TenantsConfigRec, TraceFiles};
use iop_transport::clock::Clock;

/// How long a claim may take before the store counts as unreachable.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a usage write may take before it is tried again later.
const USAGE_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// The Edge's tenants.
pub struct Tenancy {
    machine: Mutex<Driven<Tenants>>,
    store: Arc<dyn TenantStore>,
    /// Settled usage not yet in the store.
    book: Mutex<UsageBook>,
    clock: Clock,
    tickets: AtomicU64,
    /// This Edge process's id in the store's concurrency gauges (R-TEN-1):
    /// a restarted Edge is a new holder, its old slots lapse with their
    /// lease.
    holder: String,
    default_max_output_tokens: u64,
    counters: TenancyCounters,
    /// Woken at every claim the store answered (or failed): admissions
    /// waiting for a claim ask again.
    claims_answered: tokio::sync::Notify,
}

/// An admission's place among its key's waiters for a claim
/// ([`iop_core::tenant::MAX_CLAIM_WAITERS`]), given back however the
/// admission ends (its client gone included).
struct ClaimWait {
    tenancy: Arc<Tenancy>,
    key: String,
    /// When it began to wait.
    since: iop_core::time::Instant,
}

impl Drop for ClaimWait {
    fn drop(&mut self) {
        self.tenancy
            .machine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .machine_mut()
            .end_claim_wait(&self.key);
    }
}

/// What `/status` shows of the tenants' store (R-TEN-3).
#[derive(Debug, Default)]
struct TenancyCounters {
    claims: AtomicU64,
    claim_failures: AtomicU64,
    usage_writes: AtomicU64,
    usage_write_failures: AtomicU64,
    /// The last claim failed and none has worked since.
    store_down: AtomicBool,
}

/// What a request asks of its tenant's limits at admission.
#[derive(Debug, Clone)]
pub struct TenantAsk<'a> {
    /// The key's id.
    pub key_id: &'a str,
    /// The key's limits.
    pub key_limits: &'a Limits,
    /// Its principal.
    pub principal: &'a str,
    /// The principal's limits.
    pub principal_limits: &'a Limits,
    /// The model as the client named it.
    pub model: &'a str,
    /// Its price (`None`: not priced).
    pub price: Option<Price>,
    /// The body's length: its prompt's tokens are at most that.
    pub body_bytes: u64,
    /// The most output tokens it asked for.
    pub max_output: Option<u64>,
    /// Durable (it will hold journal bytes), and in the background.
    pub durable: bool,
    /// In the background.
    pub background: bool,
    /// What the key and the principal hold in the journal now.
    pub held: (Held, Held),
}

/// What a request's limits said at admission, for its `x-ratelimit-*`
/// headers (R-TEN-1).
#[derive(Debug, Clone, Copy, Default)]
pub struct RateHeaders {
    /// (limit, remaining, reset ms) of requests per minute.
    pub requests: Option<(u64, u64, u64)>,
    /// The same for tokens per minute.
    pub tokens: Option<(u64, u64, u64)>,
}

impl RateHeaders {
    /// OpenAI's `x-ratelimit-*` headers.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (kind, state) in [("requests", self.requests), ("tokens", self.tokens)] {
            let Some((limit, remaining, reset_ms)) = state else {
                continue;
            };
            for (name, value) in [
                (format!("x-ratelimit-limit-{kind}"), limit.to_string()),
                (
                    format!("x-ratelimit-remaining-{kind}"),
                    remaining.to_string(),
                ),
                (
                    format!("x-ratelimit-reset-{kind}"),
                    format!("{}ms", reset_ms),
                ),
            ] {
                if let (Ok(name), Ok(value)) =
                    (HeaderName::try_from(name), HeaderValue::try_from(value))
                {
                    headers.insert(name, value);
                }
            }
        }
    }
}

/// A request's hold on its limits: settled when dropped, with the usage
/// recorded (nothing recorded: it called no provider, and is released).
pub struct TenantHold {
    tenancy: Arc<Tenancy>,
    ticket: u64,
    /// Its prompt's tokens as its reservation estimated them (R-TEN-2:
    /// what an attempt cut without a usage report is charged as input).
    prompt_tokens: u64,
    /// The most output tokens its provider may be asked for (core's
    /// `AdmitRequest::output_cap`, R-TEN-2).
    output_cap: Option<u64>,
    used: Mutex<Metered>,
    /// Its rate headers.
    pub headers: RateHeaders,
}

impl TenantHold {
    /// The usage the request's answer reported so far (summed over its
    /// attempts by the request machine).
    pub fn record(&self, usage: &iop_wire::Usage) {
        self.used.lock().unwrap_or_else(|e| e.into_inner()).reported =
            Some(TokenUse::of_usage(usage));
    }
}

/// What a hold settles with (R-TEN-2).
#[derive(Debug, Default)]
struct Metered {
    /// The usage the answer reported, summed over its attempts.
    reported: Option<TokenUse>,
    /// Tokens no usage report covers, estimated by the request machine
    /// (`Request::unmetered`).
    unmetered: Unmetered,
    /// The answer was left unfinished to a takeover: never settled here.
    left: bool,
}

impl TenantHold {
    /// The answer is charged by the Edge that took its record over
    /// (`Request::answer_charged_elsewhere`): the usage it reported is not
    /// charged here (R-TEN-2).
    pub fn forget_reported(&self) {
        self.used.lock().unwrap_or_else(|e| e.into_inner()).reported = None;
    }

    /// The request ended: the tokens no usage report covers (estimated by
    /// its machine, `Request::unmetered`: a cut attempt's prompt and text)
    /// are charged with what it reported (R-TEN-2).
    pub fn record_unmetered(&self, unmetered: Unmetered) {
        self.used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unmetered = unmetered;
    }

    /// Its prompt's tokens as its reservation estimated them: the request
    /// machine's `RequestSpec::prompt_tokens` (R-TEN-2).
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens
    }

    /// The most output tokens the request's provider may be asked for:
    /// what it reserved when the client set no maximum and a limit counts
    /// its tokens or spend (R-TEN-2); `None`: nothing to impose.
    pub fn output_cap(&self) -> Option<u64> {
        self.output_cap
    }

    /// The Edge stops with the request's durable answer unfinished: its
    /// reservation stays counted (never given back), as a dead Edge's
    /// does, for the Edge that takes the answer over charges the run it
    /// adopts or continues (R-TEN-2, R-TAKE-1).
    pub fn leave_to_takeover(&self) {
        self.used.lock().unwrap_or_else(|e| e.into_inner()).left = true;
    }

    /// Reserve for a further attempt of the request that sends its prompt
    /// again, with `extra_input_tokens` more input (R-TEN-2; the request
    /// machine's `ReserveAttempt`): a direct answer, as at admission.
    pub fn reserve_attempt(&self, extra_input_tokens: u64) -> Result<(), AttemptRefusal> {
        self.tenancy
            .reserve_attempt(self.ticket, extra_input_tokens)
    }
}

impl std::fmt::Debug for TenantHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantHold")
            .field("ticket", &self.ticket)
            .finish()
    }
}

impl Drop for TenantHold {
    fn drop(&mut self) {
        let metered = std::mem::take(&mut *self.used.lock().unwrap_or_else(|e| e.into_inner()));
        if metered.left {
            return;
        }
        let used = TokenUse::settled(metered.reported, metered.unmetered);
        self.tenancy.settle(self.ticket, used);
    }
}

impl Tenancy {
    /// The tenants of an Edge, counting in `store`.
    pub fn new(
        config: TenantsConfig,
        clock: Clock,
        default_max_output_tokens: u64,
        store: Arc<dyn TenantStore>,
        traces: &TraceFiles,
    ) -> Self {
        let tap = traces
            .tap(MachineKind::EdgeTenants, || TenantsConfigRec { config })
            .unwrap_or_else(|e| {
                tracing::error!(event = "edge_trace_open_failed", machine = "edge-tenants", error = %e);
                Tap::off()
            });
        Tenancy {
            machine: Mutex::new(Driven::new(Tenants::new(config), tap)),
            store,
            book: Mutex::new(UsageBook::new()),
            clock,
            tickets: AtomicU64::new(1),
            holder: format!(
                "edge-{}-{}",
                std::process::id(),
                iop_transport::clock::unix_ms()
            ),
            default_max_output_tokens,
            counters: TenancyCounters::default(),
            claims_answered: tokio::sync::Notify::new(),
        }
    }

    /// The store tenants' state lives in.
    pub fn store(&self) -> &Arc<dyn TenantStore> {
        &self.store
    }

    /// The core's admission request for `ask` under `ticket`.
    fn admit_request(&self, ticket: u64, ask: &TenantAsk<'_>) -> AdmitRequest {
        AdmitRequest {
            ticket,
            key: ask.key_id.to_owned(),
            principal: ask.principal.to_owned(),
            key_limits: ask.key_limits.clone(),
            principal_limits: ask.principal_limits.clone(),
            price: ask.price,
            prompt_tokens_max: iop_core::tenant::prompt_tokens_max(ask.body_bytes),
            output_tokens_max: ask.max_output.unwrap_or(self.default_max_output_tokens),
            unix_ms: iop_transport::clock::unix_ms(),
            model: ask.model.to_owned(),
            durable: ask.durable,
            background: ask.background,
            key_held: ask.held.0,
            principal_held: ask.held.1,
        }
    }

    /// Admit a request (R-TEN-1, R-TEN-2), or say which limit refuses it
    /// and when to try again. Every admitted request holds a
    /// [`TenantHold`] (its usage is recorded whether or not it is limited).
    /// Refused only because a claim is on its way (this Edge holds too
    /// little while the window may have room), it waits for the store's
    /// answer as core's [`Tenants::admit_waiting`] says: woken by each
    /// claim answered, at most [`iop_core::tenant::CLAIM_WAIT`], a bounded
    /// number per key.
    pub async fn admit(
        self: &Arc<Self>,
        ask: &TenantAsk<'_>,
    ) -> Result<TenantHold, crate::api::ApiError> {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let mut request = self.admit_request(ticket, ask);
        let mut waiting: Option<ClaimWait> = None;
        loop {
            // Listening before asking: an answer between the two wakes it.
            let answered = self.claims_answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            request.unix_ms = iop_transport::clock::unix_ms();
            let (now, admission, headers, claims) = {
                let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
                let now = self.clock.now();
                let admission = machine.machine_mut().admit_waiting(
                    now,
                    &request,
                    waiting.as_ref().map(|w| w.since),
                );
                let claims = machine.drain_all(now);
                // The tightest of the key's, the principal's and each
                // one's for the model, as this Edge knows them (R-TEN-1);
                // a refused limit shows only the room this Edge could give
                // now.
                let m = machine.machine();
                let state = |meter: Meter| {
                    match &admission {
                        Admission::Refused(refusal) => m.refused_rate(&request, meter, refusal),
                        _ => m.tighter_rate(&request, meter),
                    }
                    .map(|s| (s.limit, s.remaining, s.reset_ms))
                };
                let headers = RateHeaders {
                    requests: state(Meter::Requests),
                    tokens: state(Meter::Tokens),
                };
                (now, admission, headers, claims)
            };
            self.send_claims(claims);
            match admission {
                Admission::Admitted => {
                    return Ok(TenantHold {
                        tenancy: self.clone(),
                        ticket,
                        prompt_tokens: request.prompt_tokens_max,
                        output_cap: request.output_cap(ask.max_output),
                        used: Mutex::default(),
                        headers,
                    });
                }
                Admission::Refused(refusal) => {
                    let mut err = refusal_error(&refusal);
                    let mut map = HeaderMap::new();
                    headers.apply(&mut map);
                    err.headers = map
                        .iter()
                        .filter_map(|(n, v)| Some((n.to_string(), v.to_str().ok()?.to_owned())))
                        .collect();
                    return Err(err);
                }
                Admission::Wait { until } => {
                    waiting.get_or_insert_with(|| ClaimWait {
                        tenancy: self.clone(),
                        key: request.key.clone(),
                        since: now,
                    });
                    let _ = tokio::time::timeout_at(self.clock.to_tokio(until), answered).await;
                }
            }
        }
    }

    /// Hold a request a takeover continues (R-TEN-2, R-TAKE-1): its
    /// admission's hold ended with the Edge that admitted it, so its
    /// continuation is held to its key's and principal's limits here. Not
    /// a new request (no rate, quota or concurrency check): every attempt
    /// it makes reserves first, and a refused one ends it with the
    /// tenant's error; settled like any request. `adopted`: it adopts the
    /// parked run, reserved at once on credit (`Tenants::admit_adopted`).
    pub fn admit_taken_over(self: &Arc<Self>, ask: &TenantAsk<'_>, adopted: bool) -> TenantHold {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let request = self.admit_request(ticket, ask);
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        if adopted {
            machine.machine_mut().admit_adopted(now, &request);
        } else {
            machine.machine_mut().admit_taken_over(now, &request);
        }
        let claims = machine.drain_all(now);
        drop(machine);
        self.send_claims(claims);
        TenantHold {
            tenancy: self.clone(),
            ticket,
            prompt_tokens: request.prompt_tokens_max,
            // The stored request carries the maximum its admission set.
            output_cap: None,
            used: Mutex::default(),
            headers: RateHeaders::default(),
        }
    }

    /// Charge `used` for a durable answer this Edge's custody ended
    /// `incomplete` without running it (R-TEN-2, R-TAKE-1: its terminal
    /// is durable at the epoch this Edge won, so no other Edge charges
    /// it): on the key and principal of `ask` (the record's), at once, on
    /// credit (`Tenants::charge_ended`); its usage row counts the request
    /// once.
    pub fn charge_ended(self: &Arc<Self>, ask: &TenantAsk<'_>, used: TokenUse) {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let request = self.admit_request(ticket, ask);
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        let (key, totals) = machine.machine_mut().charge_ended(now, &request, used);
        machine.handle_timeout(now);
        let claims = machine.drain_all(now);
        drop(machine);
        self.book
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(key, totals);
        self.send_claims(claims);
    }

    fn reserve_attempt(
        self: &Arc<Self>,
        ticket: u64,
        extra_input_tokens: u64,
    ) -> Result<(), AttemptRefusal> {
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        let reserved = machine.machine_mut().reserve_attempt(
            now,
            ticket,
            extra_input_tokens,
            iop_transport::clock::unix_ms(),
        );
        let claims = machine.drain_all(now);
        drop(machine);
        self.send_claims(claims);
        if let Err(AttemptRefusal {
            refusal,
            claim_pending: false,
        }) = &reserved
        {
            tracing::info!(
                event = "edge_tenant_attempt_refused",
                meter = refusal.meter.map_or("requests in flight", Meter::as_str),
                "a further attempt does not fit its tenant's limits: the request ends without it"
            );
        }
        reserved
    }

    fn settle(self: &Arc<Self>, ticket: u64, used: Option<TokenUse>) {
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        let row = match used {
            Some(used) => machine.machine_mut().settle(now, ticket, used),
            None => machine.machine_mut().release(now, ticket),
        };
        machine.handle_timeout(now);
        let claims = machine.drain_all(now);
        drop(machine);
        if let Some((key, totals)) = row {
            self.book
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add(key, totals);
        }
        self.send_claims(claims);
    }

    /// Carry each claim to the store off the caller's path; its answer (or
    /// its failure within [`CLAIM_TIMEOUT`]) goes back to the machine.
    fn send_claims(self: &Arc<Self>, claims: Vec<TenantsOutput>) {
        if claims.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime (the process is ending): the claims fail, as a
            // store out of reach would.
            for claim in claims {
                self.answered(failed(claim));
            }
            return;
        };
        for claim in claims {
            let (counter, amount, limit) = match claim {
                TenantsOutput::Claim {
                    counter,
                    amount,
                    limit,
                } => (counter, amount, limit),
                TenantsOutput::GiveBack { counter, amount } => {
                    // R-TEN-3: applied once by the store however often it
                    // is sent (the machine sends a failed one again).
                    let tenancy = self.clone();
                    runtime.spawn(async move {
                        let answer = tokio::time::timeout(
                            CLAIM_TIMEOUT,
                            tenancy.store.give_back(
                                counter.clone(),
                                tenancy.holder.clone(),
                                amount,
                                iop_transport::clock::unix_ms(),
                            ),
                        )
                        .await;
                        let outcome = match answer {
                            Ok(Ok(outcome)) => Some(outcome),
                            Ok(Err(e)) => {
                                tracing::warn!(event = "edge_tenant_give_back_failed", meter = counter.meter.as_str(), amount, error = %e);
                                None
                            }
                            Err(_) => {
                                tracing::warn!(event = "edge_tenant_give_back_failed", meter = counter.meter.as_str(), amount, error = "timed out");
                                None
                            }
                        };
                        tenancy.answered(TenantsInput::GaveBack { counter, outcome });
                    });
                    continue;
                }
                TenantsOutput::HoldSlots {
                    counter,
                    want,
                    limit,
                    lease_ms,
                } => {
                    let tenancy = self.clone();
                    runtime.spawn(async move {
                        let answer = tokio::time::timeout(
                            CLAIM_TIMEOUT,
                            tenancy.store.hold_slots(SlotAsk {
                                counter: counter.clone(),
                                holder: tenancy.holder.clone(),
                                want,
                                limit,
                                now_unix_ms: iop_transport::clock::unix_ms(),
                                lease_ms,
                            }),
                        )
                        .await;
                        let held = match answer {
                            Ok(Ok(held)) => Some(held),
                            Ok(Err(e)) => {
                                tracing::warn!(event = "edge_tenant_claim_failed", meter = counter.meter.as_str(), error = %e);
                                None
                            }
                            Err(_) => {
                                tracing::warn!(event = "edge_tenant_claim_failed", meter = counter.meter.as_str(), error = "timed out");
                                None
                            }
                        };
                        tenancy.answered(TenantsInput::SlotsHeld { counter, held });
                    });
                    continue;
                }
            };
            let tenancy = self.clone();
            runtime.spawn(async move {
                let answer = tokio::time::timeout(
                    CLAIM_TIMEOUT,
                    tenancy.store.claim(counter.clone(), amount, limit),
                )
                .await;
                let granted = match answer {
                    Ok(Ok(granted)) => Some(granted),
                    Ok(Err(e)) => {
                        tracing::warn!(event = "edge_tenant_claim_failed", meter = counter.meter.as_str(), error = %e);
                        None
                    }
                    Err(_) => {
                        tracing::warn!(event = "edge_tenant_claim_failed", meter = counter.meter.as_str(), error = "timed out");
                        None
                    }
                };
                tenancy.answered(TenantsInput::Claimed { counter, granted });
            });
        }
    }

    /// Renew the leases on concurrency slots that are due and forget the
    /// windows no longer used (the machine's timers; called every
    /// `usage_flush_ms`).
    pub fn tick(self: &Arc<Self>) {
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        if machine.machine().poll_timeout().is_none_or(|t| t > now) {
            return;
        }
        machine.handle_timeout(now);
        let claims = machine.drain_all(now);
        drop(machine);
        self.send_claims(claims);
    }

    /// Give back what this Edge holds, at shutdown once its requests
    /// drained (R-TEN-1, R-TEN-2, R-TEN-3): every concurrency slot, and
    /// the unused rest of every window's chunks (requests, tokens, spend)
    /// that no request in flight still holds. Core's [`Tenants::hand_back`]
    /// says what goes back; each give-back is carried to the store and
    /// answered as any ask is (a failed one is sent again when the machine
    /// says, the store applying it once), until the machine is done or
    /// `within` is over (slots left then lapse with their lease; an
    /// allowance not given back stays claimed until its window ends). The
    /// log line says how much went back, as `/status` does.
    pub async fn hand_back(self: &Arc<Self>, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        let asks = {
            let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
            let now = self.clock.now();
            machine
                .machine_mut()
                .hand_back(iop_transport::clock::unix_ms());
            machine.drain_all(now)
        };
        self.send_claims(asks);
        loop {
            // Listening before looking: an answer between the two wakes it.
            let answered = self.claims_answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            let (done, wake, asks) = {
                let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
                let now = self.clock.now();
                // A give-back that failed is sent again when it is due.
                if machine.machine().poll_timeout().is_some_and(|t| t <= now) {
                    machine.handle_timeout(now);
                }
                let asks = machine.drain_all(now);
                let m = machine.machine();
                // Only a timer still ahead wakes the wait (one the machine
                // keeps due, a window in use, would spin it).
                (m.handed_back(), m.poll_timeout().filter(|t| *t > now), asks)
            };
            self.send_claims(asks);
            let given = self.given_back();
            if done {
                tracing::info!(
                    event = "edge_tenant_slots_handed_back",
                    given_back_requests = given.requests,
                    given_back_tokens = given.tokens,
                    given_back_spend_micros = given.spend_micros,
                    "the slots and the unused rest of the windows went back"
                );
                return;
            }
            let until = wake.map_or(deadline, |t| self.clock.to_tokio(t).min(deadline));
            if tokio::time::timeout_at(until, answered).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                tracing::warn!(
                    event = "edge_tenant_slots_hand_back_timed_out",
                    given_back_requests = given.requests,
                    given_back_tokens = given.tokens,
                    given_back_spend_micros = given.spend_micros,
                    "the slots not given back come back when their lease lapses; an allowance not given back stays claimed until its window ends"
                );
                return;
            }
        }
    }

    /// What the store freed of this Edge's give-backs at its stop.
    fn given_back(&self) -> GivenBack {
        let machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let given = machine.machine().given_back();
        let of = |meter| given.get(&meter).copied().unwrap_or(0);
        GivenBack {
            requests: of(Meter::Requests),
            tokens: of(Meter::Tokens),
            spend_micros: of(Meter::Spend),
        }
    }

    fn answered(self: &Arc<Self>, input: TenantsInput) {
        let ok = match &input {
            TenantsInput::Claimed { granted, .. } => granted.is_some(),
            TenantsInput::SlotsHeld { held, .. } => held.is_some(),
            TenantsInput::GaveBack { outcome, .. } => outcome.is_some(),
        };
        self.counters.claims.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.counters.claim_failures.fetch_add(1, Ordering::Relaxed);
        }
        let granted = ok.then_some(());
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        machine.handle_input(now, input);
        let down = machine.machine().store_down();
        let claims = machine.drain_all(now);
        drop(machine);
        self.claims_answered.notify_waiters();
        if self.counters.store_down.swap(down, Ordering::Relaxed) != down {
            if down {
                tracing::error!(
                    event = "edge_tenant_store_unreachable",
                    "budgets fail closed and rate limits use this Edge's local share until the store answers"
                );
            } else {
                tracing::info!(event = "edge_tenant_store_reachable");
            }
        }
        // A claim that follows an answer goes out only while the store
        // answers (the machine asks again at the next admission); a
        // give-back (stopping, after a claim's answer) goes out whatever
        // the answer was, or the stop would wait for it in vain.
        if granted.is_some() {
            self.send_claims(claims);
        } else {
            self.send_claims(
                claims
                    .into_iter()
                    .filter(|c| matches!(c, TenantsOutput::GiveBack { .. }))
                    .collect(),
            );
        }
    }

    /// Write the settled usage to the store (R-TEN-5); rows the store did
    /// not take wait for the next write.
    pub async fn flush_usage(&self) {
        let rows = {
            let mut book = self.book.lock().unwrap_or_else(|e| e.into_inner());
            if book.is_empty() {
                return;
            }
            book.take()
        };
        let kept = rows.clone();
        let failed =
            match tokio::time::timeout(USAGE_WRITE_TIMEOUT, self.store.add_usage(rows)).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => {
                    tracing::warn!(event = "edge_tenant_usage_write_failed", error = %e.error);
                    Some(e.unwritten)
                }
                // Unknown how much was written: what is kept may be counted
                // twice, never lost.
                Err(_) => {
                    tracing::warn!(
                        event = "edge_tenant_usage_write_failed",
                        error = "timed out"
                    );
                    Some(kept)
                }
            };
        self.counters.usage_writes.fetch_add(1, Ordering::Relaxed);
        if let Some(rows) = failed {
            self.counters
                .usage_write_failures
                .fetch_add(1, Ordering::Relaxed);
            self.book
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .put_back(rows);
        }
    }

    /// Write usage every `every` and sweep the store's windows that are
    /// over every hour, until the task is dropped (the Edge's shutdown
    /// writes once more with [`Self::flush_usage`]).
    pub fn spawn_usage_writer(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let tenancy = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_sweep = tokio::time::Instant::now();
            loop {
                tick.tick().await;
                tenancy.tick();
                tenancy.flush_usage().await;
                if last_sweep.elapsed() >= Duration::from_secs(3_600) {
                    last_sweep = tokio::time::Instant::now();
                    let now = iop_transport::clock::unix_ms();
                    if let Ok(Err(e)) =
                        tokio::time::timeout(USAGE_WRITE_TIMEOUT, tenancy.store.sweep(now)).await
                    {
                        tracing::warn!(event = "edge_tenant_sweep_failed", error = %e);
                    }
                }
            }
        })
    }

    /// What `/status` shows of tenants: the store's state and today's
    /// totals per principal (R-TEN-5), read from the store within
    /// `bound`.
    pub async fn status(&self, bound: Duration) -> serde_json::Value {
        let c = &self.counters;
        let today = iop_core::tenant::usage::day_of(iop_transport::clock::unix_ms());
        let query = iop_core::tenant::usage::UsageQuery {
            from_day_unix_ms: today,
            to_day_unix_ms: today,
            principal: None,
            key: None,
            max_rows: MAX_STATUS_ROWS,
        };
        let principals = match tokio::time::timeout(bound, self.store.usage(query)).await {
            Ok(Ok(rows)) => {
                let mut sums: BTreeMap<String, UsageTotals> = BTreeMap::new();
                for (key, totals) in &rows {
                    sums.entry(key.principal.clone()).or_default().add(totals);
                }
                serde_json::json!(
                    sums.iter()
                        .map(|(p, t)| (p.clone(), totals_json(t)))
                        .collect::<serde_json::Map<_, _>>()
                )
            }
            Ok(Err(e)) => serde_json::json!({ "error": e.to_string() }),
            Err(_) => serde_json::json!({ "error": "the store did not answer in time" }),
        };
        let given = self.given_back();
        let (reservations, slots_held) = {
            let machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
            let m = machine.machine();
            (m.reservations(), m.slots_held_total())
        };
        serde_json::json!({
            "store_reachable": !c.store_down.load(Ordering::Relaxed),
            "claims": c.claims.load(Ordering::Relaxed),
            "claim_failures": c.claim_failures.load(Ordering::Relaxed),
            "usage_writes": c.usage_writes.load(Ordering::Relaxed),
            "usage_write_failures": c.usage_write_failures.load(Ordering::Relaxed),
            "requests_in_flight": reservations,
            "slots_held": slots_held,
            "given_back": {
                "requests": given.requests,
                "tokens": given.tokens,
                "spend_micros": given.spend_micros,
            },
            "today": { "day": today / 1_000, "principals": principals },
        })
    }
}

/// The store's answer to `claim` when it could not be asked.
fn failed(claim: TenantsOutput) -> TenantsInput {
    match claim {
        TenantsOutput::Claim { counter, .. } => TenantsInput::Claimed {
            counter,
            granted: None,
        },
        TenantsOutput::HoldSlots { counter, .. } => TenantsInput::SlotsHeld {
            counter,
            held: None,
        },
        TenantsOutput::GiveBack { counter, .. } => TenantsInput::GaveBack {
            counter,
            outcome: None,
        },
    }
}

/// What a stopping Edge's give-backs freed, per meter (R-TEN-3).
#[derive(Debug, Clone, Copy, Default)]
struct GivenBack {
    requests: u64,
    tokens: u64,
    spend_micros: u64,
}

/// The most usage rows `/status` reads.
const MAX_STATUS_ROWS: usize = 10_000;

/// A row's totals as the admin API and `/status` show them.
pub fn totals_json(t: &UsageTotals) -> serde_json::Value {
    serde_json::json!({
        "requests": t.requests,
        "input_tokens": t.input_tokens,
        "cached_input_tokens": t.cached_input_tokens,
        "output_tokens": t.output_tokens,
        "spend_micros": t.spend_micros,
    })
}

/// A usage row as the admin API shows it.
pub fn usage_row_json(key: &UsageKey, t: &UsageTotals) -> serde_json::Value {
    let mut row = totals_json(t);
    row["day"] = serde_json::json!(key.day_unix_ms / 1_000);
    row["principal"] = serde_json::json!(key.principal);
    row["key"] = serde_json::json!(key.key);
    row["model"] = serde_json::json!(key.model);
    row
}

/// The API error of a refusal: 429 `rate_limit_exceeded` or
/// `insufficient_quota`, with `Retry-After` when waiting helps.
fn refusal_error(refusal: &Refusal) -> crate::api::ApiError {
    let whose = match &refusal.subject {
        Subject::Key(_) | Subject::KeyModel { .. } => "this key's",
        Subject::Principal(_) | Subject::PrincipalModel { .. } => "this principal's",
    };
    let mut what = match refusal.meter {
        Some(m) => format!("{whose} {} limit", m.as_str()),
        None => format!("{whose} limit of requests in flight"),
    };
    if let Some(model) = refusal.subject.model() {
        what.push_str(&format!(" for model {model:?}"));
    }
    let retry_after_secs = refusal.retry_after_ms.map(|ms| ms.div_ceil(1_000).max(1));
    match refusal.kind {
        RefusalKind::RateLimited => {
            crate::api::ApiError::tenant_rate_limited(&what, retry_after_secs)
        }
        RefusalKind::InsufficientQuota => {
            crate::api::ApiError::insufficient_quota(&what, retry_after_secs)
        }
    }
}
