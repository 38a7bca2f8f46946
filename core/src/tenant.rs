//! Tenants' limits and budgets (SPEC §9: R-TEN-1, R-TEN-2, R-TEN-3), as a
//! sans-IO machine: one [`Tenants`] per Edge.
//!
//! Every API key belongs to a *principal*. Limits and budgets are set per
//! key and per principal, and a request is checked against both: the
//! tighter wins (R-TEN-1). What is counted:
//!
//! * requests per minute and tokens per minute (input + output, from the
//!   provider's usage), in fixed windows of wall-clock minutes;
//! * spend, priced per model ([`Price`]), against a budget per day, month
//!   or in total (R-TEN-2);
//! * requests in flight (a gauge, on this Edge).
//!
//! # Across Edges (R-TEN-3)
//!
//! A windowed count lives in the deployment's shared store as one counter
//! per (subject, meter, window): how much of the window's allowance the
//! Edges have *claimed*. An Edge claims a chunk at a time
//! ([`TenantsOutput::Claim`]; the store applies [`check_claim`], a
//! compare-and-set that never claims past the limit) and admits from what
//! it holds, so no request waits on the store. While a claim is on its way
//! an Edge may spend up to one chunk on credit; a claim that finds the
//! window exhausted leaves that credit as the only overshoot, so a
//! window's total use stays within `limit + Edges x chunk`
//! ([`TenantsConfig::chunk_fraction`]).
//!
//! When the store cannot be reached (a claim failed and none has worked
//! since), budgets fail closed: nothing is spent beyond what is held.
//! Rate limits fall back to a local share of the limit
//! ([`TenantsConfig::local_share`]), counted per window on this Edge.
//!
//! # Reservations (R-TEN-2)
//!
//! A request reserves at admission what it may cost at most: its prompt's
//! tokens as estimated from above (the Edge counts its bytes) plus its
//! maximum output tokens, priced; for tokens per minute, the same tokens.
//! A request whose reservation does not fit is refused before any
//! provider call. When it ends it is settled with the usage summed over
//! all its attempts: the unused part is returned to this Edge's holding,
//! an excess is taken from it, claimed like any use. The bound above
//! holds while what a request settles stays within what it reserved (a
//! prompt estimated from above, output within its maximum); an attempt
//! beyond the first (failover, continuation) sends the prompt again and
//! must reserve again before it starts ([`Tenants::reserve_attempt`], which
//! the request machine asks for); settling gives back every reservation of
//! the request once and charges what it used once. A request that ended without a
//! provider call is released: it used nothing but its request count. A
//! takeover's adoption of a dead Edge's parked run is reserved on credit
//! ([`Tenants::admit_adopted`]): the dead Edge's reservation of the same
//! terms stays counted in its claims, so the bound holds.
//!
//! One principal's use never changes another's admission: every count is
//! keyed by its subject.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[cfg(feature = "planted-bugs")]
use crate::planted::{Planted, PlantedBug};
use crate::time::Instant;

pub mod give_back;
pub mod key_format;
pub mod keys;
mod model_limits;
pub mod slots;
pub mod usage;

pub use give_back::{
    ClaimedCounter, GiveBackOutcome, MAX_GIVE_BACKS, check_give_back, window_over,
};
pub use model_limits::{
    LimitsError, MAX_MODEL_LIMITS, MAX_MODEL_NAME_BYTES, ModelLimits, model_name_ok,
};
use usage::{UsageKey, UsageTotals, day_of};

/// Milliseconds in a rate window.
pub const MINUTE_MS: u64 = 60_000;

/// Milliseconds in a day (budget periods are UTC days).
pub const DAY_MS: u64 = 86_400_000;

/// What limits and budgets apply to: a key, the principal it belongs to,
/// or either of them for one model (R-TEN-1: limits per model).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Subject {
    /// An API key, by its id (never its secret).
    Key(String),
    /// A principal.
    Principal(String),
    /// A key's use of one model (the model as the client named it).
    /// (Variants are only ever added at the end: stored counters name
    /// their subject by its position.)
    KeyModel {
        /// The key's id.
        key: String,
        /// The model.
        model: String,
    },
    /// A principal's use of one model.
    PrincipalModel {
        /// The principal.
        principal: String,
        /// The model.
        model: String,
    },
}

impl Subject {
    /// The model a per-model subject counts (`None`: a key's or a
    /// principal's whole use).
    pub fn model(&self) -> Option<&str> {
        match self {
            Subject::Key(_) | Subject::Principal(_) => None,
            Subject::KeyModel { model, .. } | Subject::PrincipalModel { model, .. } => Some(model),
        }
    }
}

/// What is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Meter {
    /// Requests per minute.
    Requests,
    /// Input + output tokens per minute.
    Tokens,
    /// Spend in micro-units of the price table's currency, per budget
    /// period.
    Spend,
    /// Bytes held in the journal (a gauge the store keeps, never a
    /// counter).
    JournalBytes,
    /// Background responses not yet ended (a gauge the store keeps).
    Background,
    /// Requests in flight: slots of a concurrency limit the Edges hold in
    /// the store ([`slots::SlotBook`]; its counter's window is 0).
    Slots,
}

impl Meter {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Meter::Requests => "requests",
            Meter::Tokens => "tokens",
            Meter::Spend => "spend",
            Meter::JournalBytes => "journal bytes",
            Meter::Background => "background responses",
            Meter::Slots => "requests in flight",
        }
    }
}

/// A budget's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    /// A UTC day.
    Day,
    /// 30 UTC days from the Unix epoch's day count (a fixed length keeps
    /// every Edge's window the same without a calendar).
    Month,
    /// For good.
    Total,
}

impl Period {
    /// The start of the period holding `unix_ms`, and its length (`None`:
    /// never ends).
    pub fn window(self, unix_ms: u64) -> (u64, Option<u64>) {
        let len = match self {
            Period::Day => DAY_MS,
            Period::Month => 30 * DAY_MS,
            Period::Total => return (0, None),
        };
        (unix_ms - unix_ms % len, Some(len))
    }
}

/// The limits of one subject; `None`: no limit of that kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Requests admitted per minute.
    pub requests_per_minute: Option<u64>,
    /// Input + output tokens per minute.
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight at once, across every Edge (R-TEN-1: slots
    /// the Edges lease from the store, [`slots`]).
    pub concurrent_requests: Option<u64>,
    /// Spend per period.
    pub budget: Option<Budget>,
    /// Bytes its durable responses may hold in the journal (a new durable
    /// request is refused while they hold this many).
    #[serde(default)]
    pub journal_bytes: Option<u64>,
    /// Background responses not yet ended.
    #[serde(default)]
    pub background_responses: Option<u64>,
    /// Rates of one model each, by the model's name as clients send it
    /// (at most [`MAX_MODEL_LIMITS`]): a request for that model must fit
    /// them as well as the whole limits above (R-TEN-1).
    #[serde(default)]
    pub per_model: BTreeMap<String, ModelLimits>,
}

impl Limits {
    /// Whether any limit or budget is set.
    pub fn any(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.tokens_per_minute.is_some()
            || self.concurrent_requests.is_some()
            || self.budget.is_some()
            || self.journal_bytes.is_some()
            || self.background_responses.is_some()
            || self.per_model.values().any(ModelLimits::any)
    }
}

/// What a subject holds in the journal now, as the store's view shows it
/// (gauges across every Edge: the journal's records name their principal
/// and key).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// Bytes its records hold.
    pub journal_bytes: u64,
    /// Its background responses without a terminal.
    pub background: u64,
}

/// A spend limit per period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// The most spend per period, in micro-units.
    pub limit_micros: u64,
    /// The period.
    pub period: Period,
}

/// A model's price per million tokens, in micro-units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Price {
    /// Input tokens.
    pub input_per_mtok: u64,
    /// Input tokens the provider served from its cache.
    pub cached_input_per_mtok: u64,
    /// Input tokens the provider wrote to its cache (Anthropic charges
    /// them above the input price).
    pub cache_write_per_mtok: u64,
    /// Output tokens.
    pub output_per_mtok: u64,
}

impl Price {
    /// The price a reservation holds a prompt at (R-TEN-2): every input
    /// token at the dearest of the input, cached-input and cache-write
    /// prices, so a prompt the provider reads from or writes to its cache
    /// settles within it.
    pub fn for_reservation(self) -> Price {
        Price {
            input_per_mtok: self
                .input_per_mtok
                .max(self.cache_write_per_mtok)
                .max(self.cached_input_per_mtok),
            ..self
        }
    }
}

/// A request's token use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUse {
    /// Input tokens, cached ones included.
    pub input: u64,
    /// Of them, served from the provider's cache.
    pub cached_input: u64,
    /// Of them, written to the provider's cache.
    pub cache_write_input: u64,
    /// Output tokens.
    pub output: u64,
}

/// The tokens of a request that no provider's usage report covers,
/// estimated by the Edge (R-TEN-2): what its settlement charges besides
/// the usage its answer reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unmetered {
    /// Input: the prompt of each attempt a provider accepted and that
    /// ended without a usage report, as its reservation estimated it
    /// ([`prompt_tokens_max`]: what the attempt sent, a continuation's
    /// answer so far included).
    pub input: u64,
    /// Output: the text of each attempt that ended without a usage report
    /// ([`text_tokens`](crate::edge::prompt_estimate::text_tokens)).
    pub output: u64,
}

impl TokenUse {
    /// A provider's usage report as the tokens it counts.
    pub fn of_usage(usage: &iop_wire::Usage) -> TokenUse {
        TokenUse {
            input: usage.prompt_tokens,
            cached_input: usage.cache_read_tokens.unwrap_or(0),
            cache_write_input: usage.cache_write_tokens.unwrap_or(0),
            output: usage.completion_tokens,
        }
    }

    /// What a request's settlement charges (R-TEN-2): the usage its
    /// providers reported, plus the tokens no report covers (the request
    /// machine's estimate, `Request::unmetered`: the prompt of each
    /// attempt a provider accepted and the text of each attempt that
    /// ended without a report). `None`: nothing was used beyond the
    /// request count (the request is released).
    pub fn settled(reported: Option<TokenUse>, unmetered: Unmetered) -> Option<TokenUse> {
        if unmetered == Unmetered::default() {
            return reported;
        }
        let mut used = reported.unwrap_or_default();
        used.input = used.input.saturating_add(unmetered.input);
        used.output = used.output.saturating_add(unmetered.output);
        Some(used)
    }

    /// Input + output.
    pub fn total(&self) -> u64 {
        self.input.saturating_add(self.output)
    }

    /// What it costs at `price`, in micro-units, rounded up (R-TEN-2):
    /// input read from the provider's cache at the cached price, input
    /// written to it at the cache-write price, the rest at the input price
    /// (the counts are clamped so no token is priced twice).
    pub fn cost(&self, price: &Price) -> u64 {
        let cached = self.cached_input.min(self.input);
        let written = self.cache_write_input.min(self.input - cached);
        let plain = self.input - cached - written;
        let micro_mtok = u128::from(plain) * u128::from(price.input_per_mtok)
            + u128::from(cached) * u128::from(price.cached_input_per_mtok)
            + u128::from(written) * u128::from(price.cache_write_per_mtok)
            + u128::from(self.output) * u128::from(price.output_per_mtok);
        u64::try_from(micro_mtok.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

/// One shared counter: a subject's meter in one window (start, Unix ms).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CounterKey {
    /// Whose.
    pub subject: Subject,
    /// What.
    pub meter: Meter,
    /// The window's start, Unix ms (0 for a budget in total).
    pub window_unix_ms: u64,
}

/// The most tokens a prompt whose request body is `body_bytes` long can
/// be, for its reservation (R-TEN-2): a tokenizer's token stands for at
/// least one byte of text, and the body holds the text and more (its
/// JSON, other fields), so its length bounds the prompt from above,
/// whatever the model. (The estimate of
/// [`prompt_estimate`](crate::edge::prompt_estimate) is closer, and may be
/// below the real count: it is for answers, never for a bound.) An image
/// sent by URL is the exception: providers charge it by its pixels;
/// price such routes with that in mind.
pub fn prompt_tokens_max(body_bytes: u64) -> u64 {
    body_bytes
}

/// The most output tokens a request of `api` asks for, for its
/// reservation (R-TEN-2): an embedding none (its answer is vectors, not
/// generated tokens), so a budget its prompt fits admits it and nothing
/// caps it; any other request its client's maximum (`None`: it set none,
/// and the route's `default_max_output_tokens` is reserved).
pub fn output_tokens_asked(api: iop_wire::RunApi, client_max: Option<u32>) -> Option<u64> {
    match api {
        iop_wire::RunApi::Embeddings => Some(0),
        _ => client_max.map(u64::from),
    }
}

/// Decide a claim on a shared counter (R-TEN-3): `claimed` of `limit` are
/// claimed by the Edges already; a claim of `amount` gets what is left of
/// it, never past the limit. Returns the counter's new claimed total and
/// the amount granted (0: the window is exhausted). Every store applies
/// this inside its compare-and-set; what an Edge gives back as it stops
/// is decided beside it, by [`check_give_back`] (exactly once per Edge
/// process and counter).
pub fn check_claim(claimed: u64, amount: u64, limit: u64) -> (u64, u64) {
    let granted = amount.min(limit.saturating_sub(claimed));
    (claimed + granted, granted)
}

/// How the machine is set up.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TenantsConfig {
    /// The chunk an Edge claims at a time, as a fraction of the limit
    /// (at least 1 unit): the overshoot bound is Edges x chunk.
    pub chunk_fraction: f64,
    /// With the store unreachable, the share of each rate limit this Edge
    /// admits alone (e.g. 1/Edges).
    pub local_share: f64,
    /// How long the concurrency slots an Edge holds stay its own without
    /// being renewed (it renews every third of it): a dead Edge's slots
    /// come back within this.
    #[serde(default = "default_slot_lease_ms")]
    pub slot_lease_ms: u64,
}

/// The default [`TenantsConfig::slot_lease_ms`].
pub const DEFAULT_SLOT_LEASE_MS: u64 = 10_000;

fn default_slot_lease_ms() -> u64 {
    DEFAULT_SLOT_LEASE_MS
}

impl Default for TenantsConfig {
    fn default() -> Self {
        TenantsConfig {
            chunk_fraction: 0.1,
            local_share: 0.5,
            slot_lease_ms: DEFAULT_SLOT_LEASE_MS,
        }
    }
}

/// What a request asks of the limits at admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitRequest {
    /// The request (unique per Edge process).
    pub ticket: u64,
    /// The key's id.
    pub key: String,
    /// Its principal.
    pub principal: String,
    /// The key's limits.
    pub key_limits: Limits,
    /// The principal's limits.
    pub principal_limits: Limits,
    /// The model's price (`None`: not priced, spends nothing).
    pub price: Option<Price>,
    /// The prompt's tokens, estimated from above.
    pub prompt_tokens_max: u64,
    /// The most output tokens (the request's maximum, or the route's
    /// default).
    pub output_tokens_max: u64,
    /// Wall-clock time, Unix ms (windows are wall-clock minutes, so every
    /// Edge counts the same window).
    pub unix_ms: u64,
    /// The model as the client named it (for usage rows).
    pub model: String,
    /// A durable request (it will hold journal bytes).
    pub durable: bool,
    /// A background request.
    pub background: bool,
    /// What the key holds in the journal now.
    pub key_held: Held,
    /// What the principal holds in the journal now.
    pub principal_held: Held,
}

/// The limits of one subject that apply to a request: a key's or a
/// principal's whole limits, or their rates for the request's model.
#[derive(Debug, Clone, Copy)]
enum Applicable<'a> {
    Whole(&'a Limits),
    Model(&'a ModelLimits),
}

impl Applicable<'_> {
    fn requests_per_minute(self) -> Option<u64> {
        match self {
            Applicable::Whole(l) => l.requests_per_minute,
            Applicable::Model(l) => l.requests_per_minute,
        }
    }

    fn tokens_per_minute(self) -> Option<u64> {
        match self {
            Applicable::Whole(l) => l.tokens_per_minute,
            Applicable::Model(l) => l.tokens_per_minute,
        }
    }

    fn concurrent_requests(self) -> Option<u64> {
        match self {
            Applicable::Whole(l) => l.concurrent_requests,
            Applicable::Model(l) => l.concurrent_requests,
        }
    }

    fn budget(self) -> Option<Budget> {
        match self {
            Applicable::Whole(l) => l.budget,
            Applicable::Model(_) => None,
        }
    }
}

impl AdmitRequest {
    /// The most output tokens its provider may be asked for when the
    /// client set no maximum (`client_max`), R-TEN-2: a request whose
    /// tokens or spend a limit counts (tokens per minute, the model's, or
    /// a budget of a priced model) reserved
    /// [`output_tokens_max`](Self::output_tokens_max) (the route's default)
    /// for its output, and is held to it, so that no answer settles past
    /// what it reserved. `None`: the client's maximum stands, or nothing
    /// counts the request's output.
    pub fn output_cap(&self, client_max: Option<u64>) -> Option<u64> {
        if client_max.is_some() {
            return None;
        }
        let counts = |limits: &Limits| {
            limits.tokens_per_minute.is_some()
                || (self.price.is_some() && limits.budget.is_some())
                || limits
                    .for_model(&self.model)
                    .is_some_and(|m| m.tokens_per_minute.is_some())
        };
        (counts(&self.key_limits) || counts(&self.principal_limits))
            .then_some(self.output_tokens_max)
    }

    /// Every subject whose limits apply to it, with them (R-TEN-1): the
    /// key and the principal first (in that order), then each one's
    /// limits for the request's model where it has some. A request is
    /// admitted only if every one admits it.
    fn applicable(&self) -> Vec<(Subject, Applicable<'_>)> {
        let mut out = vec![
            (
                Subject::Key(self.key.clone()),
                Applicable::Whole(&self.key_limits),
            ),
            (
                Subject::Principal(self.principal.clone()),
                Applicable::Whole(&self.principal_limits),
            ),
        ];
        if let Some(limits) = self.key_limits.for_model(&self.model) {
            out.push((
                Subject::KeyModel {
                    key: self.key.clone(),
                    model: self.model.clone(),
                },
                Applicable::Model(limits),
            ));
        }
        if let Some(limits) = self.principal_limits.for_model(&self.model) {
            out.push((
                Subject::PrincipalModel {
                    principal: self.principal.clone(),
                    model: self.model.clone(),
                },
                Applicable::Model(limits),
            ));
        }
        out
    }
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    /// Over a rate: 429 `rate_limit_exceeded`.
    RateLimited,
    /// Over a quota or budget: 429 `insufficient_quota`.
    InsufficientQuota,
}

/// A refused request: which limit, and when to try again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// Rate or quota.
    pub kind: RefusalKind,
    /// Whose limit.
    pub subject: Subject,
    /// Which meter (`None`: requests in flight).
    pub meter: Option<Meter>,
    /// When it may fit again, ms from now (`None`: not by waiting).
    pub retry_after_ms: Option<u64>,
    /// Refused only because this Edge holds too little of the allowance
    /// while a claim that would let it fit is on its way to the store (the
    /// window itself may have room): an admission may wait for the claim
    /// ([`Tenants::admit_waiting`]) and ask again.
    #[serde(default)]
    pub claim_pending: bool,
}

/// A further attempt's reservation that does not fit (R-TEN-2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRefusal {
    /// Which limit, and when it may fit.
    pub refusal: Refusal,
    /// A claim that would let it fit is on its way to the store (this Edge
    /// holds too little of the allowance, not the window too little):
    /// asked again once the store answered, it may fit. An attempt follows
    /// its failed one at once, often before the claim its admission set
    /// off is answered.
    pub claim_pending: bool,
}

/// What `x-ratelimit-*` headers say for one meter (R-TEN-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateState {
    /// The tighter limit per minute.
    pub limit: u64,
    /// What is left of it in this window, as this Edge knows.
    pub remaining: u64,
    /// Until the window resets, ms.
    pub reset_ms: u64,
}

/// What an admitted request holds until it is settled or released.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Reservation {
    /// (counter, amount reserved).
    held: Vec<(CounterKey, u64)>,
    /// Subjects whose in-flight count it holds.
    in_flight: Vec<Subject>,
    price: Option<Price>,
    /// Its usage row (the day it was admitted).
    usage: UsageKey,
    /// What a further attempt reserves again (R-TEN-2).
    again: AttemptTerms,
    /// Its first reservation is held: its admission's, or its adoption's
    /// (a taken-over request that continues holds none until it reserves
    /// an attempt).
    first: bool,
    /// Further attempts reserved.
    attempts: u32,
}

/// What each further attempt of a request that sends its prompt again
/// reserves (R-TEN-2): the tokens and spend of its admission's
/// reservation, on the same subjects' counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct AttemptTerms {
    /// (counter, limit, refusal, end of its window in Unix ms): tokens
    /// count in the attempt's own minute, spend in the admission's period.
    meters: Vec<(CounterKey, u64, RefusalKind, Option<u64>)>,
    /// Input + output tokens of one attempt.
    tokens: u64,
    /// Its spend.
    spend: u64,
}

/// One counter as this Edge holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Holding {
    /// The limit (the tightest seen for this counter).
    limit: u64,
    /// Claimed from the store and granted to this Edge.
    granted: u64,
    /// Used: reserved by requests in flight and settled.
    used: u64,
    /// A claim of this amount is on its way.
    claiming: Option<u64>,
    /// The store said the window has nothing left.
    exhausted: bool,
    /// When this Edge last used it (a window it no longer uses is
    /// forgotten).
    last_used: Option<Instant>,
}

/// The slots of one subject's concurrency limit this Edge holds (R-TEN-1,
/// [`slots`]); its requests in flight are [`Tenants`]' `in_flight`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SlotHolding {
    /// The limit (the tightest seen).
    limit: u64,
    /// What the store last said this Edge holds.
    granted: u64,
    /// An ask for this many is on its way.
    asking: Option<u64>,
    /// The store granted less than asked: no credit, and no ask for more,
    /// until then.
    full_until: Option<Instant>,
    /// When to ask next (renew the lease, or retry a failed ask).
    next_ask: Option<Instant>,
    /// When a request last took or left a slot.
    last_used: Option<Instant>,
}

/// One input of [`Tenants`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TenantsInput {
    /// The store's answer to a [`TenantsOutput::Claim`]: the amount
    /// granted, or `None` when the store could not be reached.
    Claimed {
        /// The counter.
        counter: CounterKey,
        /// Granted (0: exhausted), or the store failed.
        granted: Option<u64>,
    },
    /// The store's answer to a [`TenantsOutput::HoldSlots`]: what this
    /// Edge holds now, or `None` when the store could not be reached.
    SlotsHeld {
        /// The gauge.
        counter: CounterKey,
        /// Held now, or the store failed.
        held: Option<u64>,
    },
    /// The store's answer to a [`TenantsOutput::GiveBack`], or `None`
    /// when it could not be reached (or did not answer in time: the
    /// give-back may have been applied; asked again, it is not applied
    /// twice).
    GaveBack {
        /// The counter.
        counter: CounterKey,
        /// What it came to, or the store failed.
        outcome: Option<GiveBackOutcome>,
    },
}

/// What the driver carries out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TenantsOutput {
    /// Claim `amount` of `counter` (whose limit is `limit`) from the
    /// shared store with [`check_claim`]; answer with
    /// [`TenantsInput::Claimed`].
    Claim {
        /// The counter.
        counter: CounterKey,
        /// How much.
        amount: u64,
        /// Its limit.
        limit: u64,
    },
    /// Set this Edge process's holding of `counter`'s slots to `want`
    /// (whose limit is `limit`) in the shared store with
    /// [`slots::SlotBook::hold`], its lease running `lease_ms` from the
    /// store's now; answer with [`TenantsInput::SlotsHeld`].
    HoldSlots {
        /// The gauge (meter [`Meter::Slots`], window 0).
        counter: CounterKey,
        /// The holding asked for.
        want: u64,
        /// Its limit.
        limit: u64,
        /// The lease.
        lease_ms: u64,
    },
    /// The Edge is stopping ([`Tenants::hand_back`]): give back `amount`
    /// of `counter`, claimed by this Edge process and unused, in the
    /// shared store with [`check_give_back`] (as this Edge process's
    /// holder, the one it holds slots as: applied at most once however
    /// often it is sent); answer with [`TenantsInput::GaveBack`].
    GiveBack {
        /// The counter.
        counter: CounterKey,
        /// How much.
        amount: u64,
    },
}

impl TenantsOutput {
    /// The counter it concerns.
    pub fn counter(&self) -> &CounterKey {
        match self {
            TenantsOutput::Claim { counter, .. }
            | TenantsOutput::HoldSlots { counter, .. }
            | TenantsOutput::GiveBack { counter, .. } => counter,
        }
    }
}

/// How long after a give-back failed (the store unreachable, or its
/// answer lost) it is sent again (R-TEN-3; the store applies it once).
pub const GIVE_BACK_RETRY_MS: u64 = 250;

/// The most times one give-back is sent ([`GIVE_BACK_RETRY_MS`] apart);
/// after that the allowance stays claimed until its window ends.
pub const MAX_GIVE_BACK_ASKS: u32 = 4;

/// A window's unused claim this Edge gives back as it stops.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GivingBack {
    /// How much (fixed when first sent: every retry sends the same).
    amount: u64,
    /// Sent and not answered.
    asking: bool,
    /// Times sent.
    asks: u32,
    /// When to send it again (it failed).
    next_ask: Option<Instant>,
    /// Answered, or given up.
    done: bool,
}

/// How long an Edge whose ask for more slots the store answered with less
/// neither asks again nor admits on credit (unless a slot of its own is
/// free): the `Retry-After` of such a refusal.
pub const SLOTS_FULL_MS: u64 = 1_000;

/// The `Retry-After` of a request refused while the claim that would let
/// it fit is on its way.
pub const CLAIM_RETRY_MS: u64 = 1_000;

/// How long an admission refused only because a claim is on its way
/// ([`Refusal::claim_pending`]) waits for the store's answer before it is
/// refused after all (R-TEN-1, R-TEN-3): as long as a further attempt asks
/// (20 x 50 ms, [`crate::edge::request::MAX_RESERVE_ASKS`]).
pub const CLAIM_WAIT: Duration = Duration::from_secs(1);

/// The most admissions of one key that wait for a claim at once
/// ([`Tenants::admit_waiting`]); the next is refused at once, so a client
/// cannot park unbounded work on an Edge.
pub const MAX_CLAIM_WAITERS: u32 = 16;

/// What an admission that may wait for a claim comes to
/// ([`Tenants::admit_waiting`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: it holds its reservation.
    Admitted,
    /// Refused only because a claim is on its way: ask again once the
    /// store answered a claim, or at `until` at the latest.
    Wait {
        /// When the wait ends (the last ask).
        until: Instant,
    },
    /// Refused.
    Refused(Refusal),
}

/// How long a window this Edge no longer uses is kept.
const FORGET_AFTER: Duration = Duration::from_secs(180);

/// The limits and budgets of every tenant, as one Edge applies them (see
/// the module docs).
#[derive(Debug)]
pub struct Tenants {
    cfg: TenantsConfig,
    holdings: BTreeMap<CounterKey, Holding>,
    /// Rate counts while the store is unreachable, per counter.
    local: BTreeMap<CounterKey, u64>,
    in_flight: BTreeMap<Subject, u64>,
    /// Slots of concurrency limits held in the store, per subject.
    slots: BTreeMap<Subject, SlotHolding>,
    reservations: BTreeMap<u64, Reservation>,
    /// Subjects whose last claim failed, none having worked since: the
    /// store is taken as unreachable for them (kept per subject, so what
    /// one principal's traffic learns never changes another's admission).
    store_down: BTreeSet<Subject>,
    /// Admissions waiting for a claim, per key ([`MAX_CLAIM_WAITERS`]).
    claim_waiters: BTreeMap<String, u32>,
    /// The Edge is stopping ([`Tenants::hand_back`]): every slot goes
    /// back, nothing more is asked for.
    stopping: bool,
    /// When it began to stop, Unix ms (windows over by then are not given
    /// back).
    stopped_unix_ms: u64,
    /// What it gives back of each window as it stops.
    giving_back: BTreeMap<CounterKey, GivingBack>,
    /// What the store freed of its give-backs, per meter.
    given_back: BTreeMap<Meter, u64>,
    outputs: VecDeque<TenantsOutput>,
    #[cfg(feature = "planted-bugs")]
    planted: Planted,
}

impl Tenants {
    /// The machine of one Edge.
    pub fn new(cfg: TenantsConfig) -> Self {
        Tenants {
            cfg,
            holdings: BTreeMap::new(),
            local: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            slots: BTreeMap::new(),
            reservations: BTreeMap::new(),
            store_down: BTreeSet::new(),
            claim_waiters: BTreeMap::new(),
            stopping: false,
            stopped_unix_ms: 0,
            giving_back: BTreeMap::new(),
            given_back: BTreeMap::new(),
            outputs: VecDeque::new(),
            #[cfg(feature = "planted-bugs")]
            planted: Planted::default(),
        }
    }

    /// Switch a planted bug on in this machine (test-only; see
    /// [`crate::planted`]).
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&self, bug: PlantedBug) {
        self.planted.plant(bug);
    }

    /// Whether the shared store is taken as unreachable (R-TEN-3).
    pub fn store_down(&self) -> bool {
        !self.store_down.is_empty()
    }

    /// Whether the store is taken as unreachable for `subject`'s counters
    /// (its rates then use the local share, R-TEN-3).
    pub fn store_down_for(&self, subject: &Subject) -> bool {
        self.store_down.contains(subject)
    }

    /// Requests admitted and not yet settled or released.
    pub fn reservations(&self) -> usize {
        self.reservations.len()
    }

    /// The chunk an Edge claims of a counter with `limit` (R-TEN-3: a
    /// window's use stays within `limit` + Edge processes x chunk).
    pub fn chunk(&self, limit: u64) -> u64 {
        ((limit as f64 * self.cfg.chunk_fraction) as u64).clamp(1, limit.max(1))
    }

    /// Admit `request` at `now`, or say why not (a direct answer: the
    /// caller needs it before anything else happens). Admitted, it holds
    /// its reservation until [`Self::settle`] or [`Self::release`].
    pub fn admit(&mut self, now: Instant, request: &AdmitRequest) -> Result<(), Refusal> {
        #[cfg_attr(not(feature = "planted-bugs"), allow(unused_mut))]
        let mut subjects = request.applicable();
        #[cfg(feature = "planted-bugs")]
        if self.planted.has(PlantedBug::IgnoreModelLimits) {
            subjects.retain(|(subject, _)| subject.model().is_none());
        }
        // The journal's quotas are the key's and the principal's alone.
        let whole = [
            (&subjects[0].0, &request.key_limits, &request.key_held),
            (
                &subjects[1].0,
                &request.principal_limits,
                &request.principal_held,
            ),
        ];
        for (subject, limits, held) in whole {
            if request.durable
                && let Some(max) = limits.journal_bytes
                && held.journal_bytes >= max
            {
                return Err(Refusal {
                    kind: RefusalKind::InsufficientQuota,
                    subject: subject.clone(),
                    meter: Some(Meter::JournalBytes),
                    retry_after_ms: None,
                    claim_pending: false,
                });
            }
            if request.background
                && let Some(max) = limits.background_responses
                && held.background >= max
            {
                return Err(Refusal {
                    kind: RefusalKind::RateLimited,
                    subject: subject.clone(),
                    meter: Some(Meter::Background),
                    retry_after_ms: Some(1_000),
                    claim_pending: false,
                });
            }
        }
        let tokens = request
            .prompt_tokens_max
            .saturating_add(request.output_tokens_max);
        let spend = request.price.map_or(0, |p| {
            // Reserved as if every prompt token were priced at the
            // dearest input rate, so a cache write never settles above it.
            let dearest = p.for_reservation();
            TokenUse {
                input: request.prompt_tokens_max,
                output: request.output_tokens_max,
                ..TokenUse::default()
            }
            .cost(&dearest)
        });
        let minute = request.unix_ms - request.unix_ms % MINUTE_MS;
        let reset_ms = minute + MINUTE_MS - request.unix_ms;
        // Every check first; nothing is taken unless all fit.
        let mut wants: Vec<(CounterKey, u64, u64, RefusalKind, Option<u64>)> = Vec::new();
        for (subject, limits) in &subjects {
            if let Some(max) = limits.concurrent_requests()
                && !self.slot_fits(now, subject, max)
            {
                // Ask the store for the slot this request needs, so it
                // fits when the store answers (R-TEN-1 across Edges).
                let coming = self.ask_slots(now, subject, max, true);
                return Err(Refusal {
                    kind: RefusalKind::RateLimited,
                    subject: subject.clone(),
                    meter: None,
                    retry_after_ms: Some(if coming {
                        CLAIM_RETRY_MS
                    } else {
                        SLOTS_FULL_MS
                    }),
                    claim_pending: coming,
                });
            }
            let counter = |meter, window_unix_ms| CounterKey {
                subject: subject.clone(),
                meter,
                window_unix_ms,
            };
            if let Some(limit) = limits.requests_per_minute() {
                wants.push((
                    counter(Meter::Requests, minute),
                    1,
                    limit,
                    RefusalKind::RateLimited,
                    Some(reset_ms),
                ));
            }
            if let Some(limit) = limits.tokens_per_minute() {
                let refusal_wait = (tokens <= limit).then_some(reset_ms);
                wants.push((
                    counter(Meter::Tokens, minute),
                    tokens,
                    limit,
                    RefusalKind::RateLimited,
                    refusal_wait,
                ));
            }
            if let Some(budget) = limits.budget()
                && request.price.is_some()
            {
                let (start, len) = budget.period.window(request.unix_ms);
                let wait = len.map(|len| start + len - request.unix_ms);
                wants.push((
                    counter(Meter::Spend, start),
                    spend,
                    budget.limit_micros,
                    RefusalKind::InsufficientQuota,
                    wait,
                ));
            }
        }
        for (key, amount, limit, kind, wait) in &wants {
            if !self.fits(key, *amount, *limit) {
                // Ask for what this request needs now, so it fits when the
                // store answers; until then it is worth trying again soon.
                let coming = self.claim_for(key, *amount, *limit);
                return Err(Refusal {
                    kind: *kind,
                    subject: key.subject.clone(),
                    meter: Some(key.meter),
                    retry_after_ms: if coming { Some(CLAIM_RETRY_MS) } else { *wait },
                    claim_pending: coming,
                });
            }
        }
        let again = AttemptTerms {
            meters: wants
                .iter()
                .filter(|(key, ..)| matches!(key.meter, Meter::Tokens | Meter::Spend))
                .map(|(key, _, limit, kind, wait)| {
                    let ends = match key.meter {
                        Meter::Spend => wait.map(|w| request.unix_ms + w),
                        _ => None,
                    };
                    (key.clone(), *limit, *kind, ends)
                })
                .collect(),
            tokens,
            spend,
        };
        let mut held = Vec::new();
        for (key, amount, limit, _, _) in wants {
            self.take(now, &key, amount, limit);
            held.push((key, amount));
        }
        let mut in_flight = Vec::new();
        for (subject, limits) in &subjects {
            if let Some(max) = limits.concurrent_requests() {
                *self.in_flight.entry(subject.clone()).or_default() += 1;
                in_flight.push(subject.clone());
                self.slot_used(now, subject, max);
            }
        }
        self.reservations.insert(
            request.ticket,
            Reservation {
                held,
                in_flight,
                price: request.price,
                usage: UsageKey {
                    day_unix_ms: day_of(request.unix_ms),
                    principal: request.principal.clone(),
                    key: request.key.clone(),
                    model: request.model.clone(),
                },
                again,
                first: true,
                attempts: 0,
            },
        );
        Ok(())
    }

    /// Admit `request` at `now` as [`Self::admit`] does, but one refused
    /// only because a claim is on its way ([`Refusal::claim_pending`]: the
    /// window may have room, this Edge does not hold it yet) waits for the
    /// store's answer instead of getting a 429 the window does not justify
    /// (R-TEN-1, R-TEN-3). `waiting_since`: `None` at the first ask; then
    /// when the first [`Admission::Wait`] came. A first wait takes one of
    /// the key's [`MAX_CLAIM_WAITERS`] places (none free: refused at once),
    /// which the caller gives back with [`Self::end_claim_wait`] when it
    /// stops asking, however it ends. Asked again before [`CLAIM_WAIT`] is
    /// over, it waits again while the claim is still on its way; after it,
    /// the refusal stands.
    pub fn admit_waiting(
        &mut self,
        now: Instant,
        request: &AdmitRequest,
        waiting_since: Option<Instant>,
    ) -> Admission {
        let refusal = match self.admit(now, request) {
            Ok(()) => return Admission::Admitted,
            Err(refusal) => refusal,
        };
        if !refusal.claim_pending {
            return Admission::Refused(refusal);
        }
        match waiting_since {
            None => {
                let waiters = self.claim_waiters.entry(request.key.clone()).or_default();
                if *waiters >= MAX_CLAIM_WAITERS {
                    return Admission::Refused(refusal);
                }
                *waiters += 1;
                Admission::Wait {
                    until: now.saturating_add(CLAIM_WAIT),
                }
            }
            Some(since) => {
                let until = since.saturating_add(CLAIM_WAIT);
                if now < until {
                    Admission::Wait { until }
                } else {
                    Admission::Refused(refusal)
                }
            }
        }
    }

    /// An admission of `key` that waited for a claim stopped asking
    /// (admitted, refused, or its caller gone): its place is free again.
    pub fn end_claim_wait(&mut self, key: &str) {
        if let Some(n) = self.claim_waiters.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.claim_waiters.remove(key);
            }
        }
    }

    /// Admissions of `key` waiting for a claim now.
    pub fn claim_waiters(&self, key: &str) -> u32 {
        self.claim_waiters.get(key).copied().unwrap_or(0)
    }

    /// Hold a taken-over request (R-TEN-2): one an Edge that is gone (or
    /// this Edge before a restart) admitted, whose reservation ended with
    /// that Edge, continued here by a takeover (R-TAKE-1). It is not a new
    /// request: not counted in the request rate again, nor held to the
    /// journal quotas or the concurrency limit (its record exists and its
    /// answer has begun). It counts as in flight, every attempt it makes
    /// reserves the tokens and spend of `request`'s terms first
    /// ([`Self::reserve_attempt`]: refused, the request ends with the
    /// refusal and calls no provider), and it is settled (or released)
    /// like any request, its usage charged to its key and principal.
    pub fn admit_taken_over(&mut self, now: Instant, request: &AdmitRequest) {
        let subjects = [
            (Subject::Key(request.key.clone()), &request.key_limits),
            (
                Subject::Principal(request.principal.clone()),
                &request.principal_limits,
            ),
        ];
        let tokens = request
            .prompt_tokens_max
            .saturating_add(request.output_tokens_max);
        let spend = request.price.map_or(0, |p| {
            TokenUse {
                input: request.prompt_tokens_max,
                output: request.output_tokens_max,
                ..TokenUse::default()
            }
            .cost(&p.for_reservation())
        });
        let minute = request.unix_ms - request.unix_ms % MINUTE_MS;
        let mut meters = Vec::new();
        let mut in_flight = Vec::new();
        for (subject, limits) in &subjects {
            let counter = |meter, window_unix_ms| CounterKey {
                subject: subject.clone(),
                meter,
                window_unix_ms,
            };
            if let Some(limit) = limits.tokens_per_minute {
                meters.push((
                    counter(Meter::Tokens, minute),
                    limit,
                    RefusalKind::RateLimited,
                    None,
                ));
            }
            if let Some(budget) = limits.budget
                && request.price.is_some()
            {
                let (start, len) = budget.period.window(request.unix_ms);
                meters.push((
                    counter(Meter::Spend, start),
                    budget.limit_micros,
                    RefusalKind::InsufficientQuota,
                    len.map(|len| start + len),
                ));
            }
            if let Some(max) = limits.concurrent_requests {
                *self.in_flight.entry(subject.clone()).or_default() += 1;
                in_flight.push(subject.clone());
                self.slot_used(now, subject, max);
            }
        }
        let usage = UsageKey {
            day_unix_ms: day_of(request.unix_ms),
            principal: request.principal.clone(),
            key: request.key.clone(),
            model: request.model.clone(),
        };
        if let Some(old) = self.reservations.insert(
            request.ticket,
            Reservation {
                held: Vec::new(),
                in_flight,
                price: request.price,
                usage,
                again: AttemptTerms {
                    meters,
                    tokens,
                    spend,
                },
                first: false,
                attempts: 0,
            },
        ) {
            // Tickets are unique per Edge process: never reached; a
            // reservation is never dropped without its counts given back.
            self.end_in_flight(now, &old);
        }
    }

    /// Hold a taken-over request that adopts its parked run (R-TEN-2,
    /// R-PARK-2): as [`Self::admit_taken_over`], and the adopted run, an
    /// attempt already under way, is reserved at once with `request`'s
    /// terms (its prompt estimated from above and its maximum output, as
    /// the admission reserved), on credit: never refused, as the answer
    /// was admitted by the Edge that is gone and the adoption sends
    /// nothing again. It settles with the usage the run reports at its
    /// end, which covers the tokens it produced before the cut too.
    ///
    /// Why the bound still holds: the Edge that admitted the request
    /// reserved the same terms and died (or restarted) without settling
    /// them, so its reservation stays counted in what it claimed from the
    /// store; the adopted run's use is within those terms, and what is
    /// charged here is the one use of it the usage rows record. Spend over
    /// every Edge stays within the budget + Edge processes x chunk (the
    /// counters count the run twice, erring on the side of refusing).
    pub fn admit_adopted(&mut self, now: Instant, request: &AdmitRequest) {
        self.admit_taken_over(now, request);
        #[cfg(feature = "planted-bugs")]
        if self.planted.has(PlantedBug::AdoptionNotCharged) {
            // As before adoptions were charged: held to nothing at all.
            if let Some(old) = self.reservations.remove(&request.ticket) {
                self.end_in_flight(now, &old);
            }
            return;
        }
        let Some(terms) = self
            .reservations
            .get(&request.ticket)
            .map(|r| r.again.clone())
        else {
            return;
        };
        let minute = request.unix_ms - request.unix_ms % MINUTE_MS;
        let mut held = Vec::with_capacity(terms.meters.len());
        for (key, limit, _, _) in &terms.meters {
            let mut key = key.clone();
            let amount = match key.meter {
                Meter::Tokens => {
                    key.window_unix_ms = minute;
                    terms.tokens
                }
                _ => terms.spend,
            };
            self.take(now, &key, amount, *limit);
            held.push((key, amount));
        }
        if let Some(reservation) = self.reservations.get_mut(&request.ticket) {
            reservation.held = held;
            reservation.first = true;
        }
    }

    /// Charge `used` for an answer no request of this Edge runs (R-TEN-2,
    /// R-TAKE-1): a durable answer a takeover ended `incomplete` without
    /// running it (its Edge died or restarted; its route does not
    /// continue answers, or its journal cannot be continued), charged by
    /// the Edge that won its record's epoch what its journal holds, on the
    /// key and principal of `request` (the record's terms). Taken at once,
    /// on credit, never refused, as an adoption's reservation is, and
    /// settled at once: the tokens and spend count `used` in this Edge's
    /// holdings, and the usage row counts the request once (the Edge that
    /// admitted it never settled it). The bound holds as for an adoption:
    /// that Edge's reservation of the same terms stays counted in what it
    /// claimed.
    pub fn charge_ended(
        &mut self,
        now: Instant,
        request: &AdmitRequest,
        used: TokenUse,
    ) -> (UsageKey, UsageTotals) {
        let spend = request.price.map_or(0, |p| used.cost(&p));
        let minute = request.unix_ms - request.unix_ms % MINUTE_MS;
        let subjects = [
            (Subject::Key(request.key.clone()), &request.key_limits),
            (
                Subject::Principal(request.principal.clone()),
                &request.principal_limits,
            ),
        ];
        for (subject, limits) in &subjects {
            if let Some(limit) = limits.tokens_per_minute {
                let key = CounterKey {
                    subject: subject.clone(),
                    meter: Meter::Tokens,
                    window_unix_ms: minute,
                };
                self.take(now, &key, used.total(), limit);
            }
            if let Some(budget) = limits.budget
                && request.price.is_some()
            {
                let (start, _) = budget.period.window(request.unix_ms);
                let key = CounterKey {
                    subject: subject.clone(),
                    meter: Meter::Spend,
                    window_unix_ms: start,
                };
                self.take(now, &key, spend, budget.limit_micros);
            }
        }
        let usage = UsageKey {
            day_unix_ms: day_of(request.unix_ms),
            principal: request.principal.clone(),
            key: request.key.clone(),
            model: request.model.clone(),
        };
        (usage, UsageTotals::of(used, spend))
    }

    /// Reserve again for a further attempt of ticket's request that sends
    /// its prompt again (R-TEN-2: a failover, a continuation), at `now`
    /// (`unix_ms` on the wall clock): the tokens and spend its admission
    /// reserved, plus `extra_input_tokens` (what a continuation sends
    /// besides the prompt: the answer so far), against the same limits;
    /// nothing is taken unless all fit. Refused, the request ends with the
    /// refusal and calls no provider again (unless a claim that would let it
    /// fit is on its way: then it may ask again shortly, see
    /// [`AttemptRefusal::claim_pending`]); either way [`Self::settle`] or
    /// [`Self::release`] ends every reservation of the ticket, once. A
    /// ticket this Edge does not hold (never admitted here, or settled)
    /// has nothing to reserve against.
    pub fn reserve_attempt(
        &mut self,
        now: Instant,
        ticket: u64,
        extra_input_tokens: u64,
        unix_ms: u64,
    ) -> Result<(), AttemptRefusal> {
        let Some(reservation) = self.reservations.get(&ticket) else {
            return Ok(());
        };
        #[cfg(feature = "planted-bugs")]
        if self.planted.has(PlantedBug::MissingReservation) {
            return Ok(());
        }
        let terms = &reservation.again;
        // Priced at the dearest input rate, as the admission's prompt is.
        let extra_spend = reservation.price.map_or(0, |p| {
            let dearest = p.for_reservation();
            TokenUse {
                input: extra_input_tokens,
                ..TokenUse::default()
            }
            .cost(&dearest)
        });
        let minute = unix_ms - unix_ms % MINUTE_MS;
        let reset_ms = minute + MINUTE_MS - unix_ms;
        let wants: Vec<(CounterKey, u64, u64, RefusalKind, Option<u64>)> = terms
            .meters
            .iter()
            .map(|(key, limit, kind, ends)| {
                let mut key = key.clone();
                let (amount, wait) = match key.meter {
                    Meter::Tokens => {
                        key.window_unix_ms = minute;
                        let amount = terms.tokens.saturating_add(extra_input_tokens);
                        (amount, (amount <= *limit).then_some(reset_ms))
                    }
                    _ => (
                        terms.spend.saturating_add(extra_spend),
                        ends.map(|end| end.saturating_sub(unix_ms)),
                    ),
                };
                (key, amount, *limit, *kind, wait)
            })
            .collect();
        for (key, amount, limit, kind, wait) in &wants {
            if !self.fits(key, *amount, *limit) {
                let coming = self.claim_for(key, *amount, *limit);
                return Err(AttemptRefusal {
                    refusal: Refusal {
                        kind: *kind,
                        subject: key.subject.clone(),
                        meter: Some(key.meter),
                        retry_after_ms: if coming { Some(CLAIM_RETRY_MS) } else { *wait },
                        claim_pending: coming,
                    },
                    claim_pending: coming,
                });
            }
        }
        let mut held = Vec::new();
        for (key, amount, limit, _, _) in wants {
            self.take(now, &key, amount, limit);
            held.push((key, amount));
        }
        if let Some(reservation) = self.reservations.get_mut(&ticket) {
            reservation.held.extend(held);
            reservation.attempts += 1;
        }
        Ok(())
    }

    /// How many reservations ticket's request holds: its admission's (or
    /// its adoption's) and one per further attempt (0: none, it was
    /// settled or never admitted here).
    pub fn reservations_of(&self, ticket: u64) -> u32 {
        self.reservations
            .get(&ticket)
            .map_or(0, |r| u32::from(r.first) + r.attempts)
    }

    /// What ticket's reservations hold, in the order they were taken:
    /// (counter, amount).
    pub fn held_by(&self, ticket: u64) -> &[(CounterKey, u64)] {
        self.reservations
            .get(&ticket)
            .map_or(&[], |r| r.held.as_slice())
    }

    /// How much of `counter` this Edge has used (reserved by requests in
    /// flight and settled), if it holds the counter.
    pub fn used(&self, counter: &CounterKey) -> Option<u64> {
        self.holdings.get(counter).map(|h| h.used)
    }

    /// Whether `amount` of `key` (limit `limit`) fits now: within what
    /// this Edge holds plus one chunk on credit while the store answers;
    /// with the store down, a budget only within what is held, a rate
    /// within this Edge's local share.
    fn fits(&self, key: &CounterKey, amount: u64, limit: u64) -> bool {
        if amount > limit {
            return false;
        }
        let holding = self.holdings.get(key);
        let (granted, used, exhausted) =
            holding.map_or((0, 0, false), |h| (h.granted, h.used, h.exhausted));
        if self.store_down.contains(&key.subject) {
            if key.meter == Meter::Spend {
                return used + amount <= granted;
            }
            let share = ((limit as f64 * self.cfg.local_share) as u64).max(1);
            let local = self.local.get(key).copied().unwrap_or(0);
            return local + amount <= share;
        }
        let credit = if exhausted { 0 } else { self.chunk(limit) };
        used + amount <= granted + credit
    }

    /// Take `amount` of `key` for a request; claim more when what is held
    /// runs low.
    fn take(&mut self, now: Instant, key: &CounterKey, amount: u64, limit: u64) {
        if self.store_down.contains(&key.subject) && key.meter != Meter::Spend {
            *self.local.entry(key.clone()).or_default() += amount;
        }
        let holding = self.holdings.entry(key.clone()).or_default();
        holding.limit = if holding.limit == 0 {
            limit
        } else {
            holding.limit.min(limit)
        };
        holding.used += amount;
        holding.last_used = Some(now);
        self.claim_more(key);
    }

    /// A request of `amount` did not fit `key` (limit `limit`): claim what
    /// it needs beyond what is held. Whether more may still come (a claim
    /// is on its way, the window is not exhausted, the store answers).
    /// With the store taken as unreachable the claim still goes out (one
    /// at a time per counter): it is how the Edge learns the store is back,
    /// while the request it was made for is refused (budgets fail closed).
    fn claim_for(&mut self, key: &CounterKey, amount: u64, limit: u64) -> bool {
        if amount > limit || self.stopping {
            return false;
        }
        let chunk = self.chunk(limit);
        let holding = self.holdings.entry(key.clone()).or_default();
        holding.limit = if holding.limit == 0 {
            limit
        } else {
            holding.limit.min(limit)
        };
        if holding.exhausted {
            return false;
        }
        if holding.claiming.is_some() {
            return true;
        }
        let short = (holding.used + amount).saturating_sub(holding.granted);
        let amount = short.max(chunk);
        holding.claiming = Some(amount);
        self.outputs.push_back(TenantsOutput::Claim {
            counter: key.clone(),
            amount,
            limit: holding.limit,
        });
        true
    }

    /// Claim the next chunk of `key` when less than half a chunk is left
    /// and no claim is on its way (R-TEN-3).
    fn claim_more(&mut self, key: &CounterKey) {
        let chunk = match self.holdings.get(key) {
            Some(h) if h.limit > 0 => self.chunk(h.limit),
            _ => return,
        };
        let Some(holding) = self.holdings.get_mut(key) else {
            return;
        };
        if holding.claiming.is_some() || holding.exhausted || self.stopping {
            return;
        }
        let left = holding.granted.saturating_sub(holding.used);
        if left * 2 >= chunk {
            return;
        }
        // Cover what is used on credit, and a chunk beyond.
        let owed = holding.used.saturating_sub(holding.granted);
        let amount = owed + chunk;
        holding.claiming = Some(amount);
        self.outputs.push_back(TenantsOutput::Claim {
            counter: key.clone(),
            amount,
            limit: holding.limit,
        });
    }

    /// Settle ticket's request with the usage summed over all its
    /// attempts (R-TEN-2): tokens and spend count what it used; what it
    /// reserved and did not use goes back to this Edge's holding. Returns
    /// its usage row and totals (R-TEN-5), once: a second settle of the
    /// same ticket changes nothing and returns `None`.
    pub fn settle(
        &mut self,
        now: Instant,
        ticket: u64,
        used: TokenUse,
    ) -> Option<(UsageKey, UsageTotals)> {
        let reservation = self.reservations.remove(&ticket)?;
        let spend = reservation.price.map_or(0, |p| used.cost(&p));
        self.end_in_flight(now, &reservation);
        // Every reservation is given back and what the request used is
        // charged once: each (subject, meter)'s use fills its reservations
        // in the order they were taken, the rest goes to the last (R-TEN-2).
        let mut left: BTreeMap<(&Subject, Meter), u64> = BTreeMap::new();
        let mut last: BTreeMap<(&Subject, Meter), usize> = BTreeMap::new();
        for (i, (key, reserved)) in reservation.held.iter().enumerate() {
            let group = (&key.subject, key.meter);
            last.insert(group, i);
            match key.meter {
                Meter::Requests => *left.entry(group).or_default() += reserved,
                Meter::Tokens => _ = left.insert(group, used.total()),
                Meter::Spend => _ = left.insert(group, spend),
                Meter::JournalBytes | Meter::Background | Meter::Slots => {}
            }
        }
        let mut charges = Vec::with_capacity(reservation.held.len());
        for (i, (key, reserved)) in reservation.held.iter().enumerate() {
            let group = (&key.subject, key.meter);
            let Some(left) = left.get_mut(&group) else {
                charges.push(None);
                continue;
            };
            let charge = if last.get(&group) == Some(&i) {
                *left
            } else {
                (*left).min(*reserved)
            };
            *left -= charge;
            charges.push(Some(charge));
        }
        #[cfg(feature = "planted-bugs")]
        let double_settle = self.planted.has(PlantedBug::DoubleSettle);
        for ((key, reserved), charge) in reservation.held.iter().zip(charges) {
            let (Some(charge), Some(holding)) = (charge, self.holdings.get_mut(key)) else {
                continue;
            };
            holding.used = holding
                .used
                .saturating_sub(*reserved)
                .saturating_add(charge);
            #[cfg(feature = "planted-bugs")]
            if double_settle {
                holding.used = holding
                    .used
                    .saturating_sub(*reserved)
                    .saturating_add(charge);
            }
            holding.last_used = Some(now);
            self.claim_more(key);
        }
        Some((reservation.usage, UsageTotals::of(used, spend)))
    }

    /// Release ticket's request: it ended without a provider call, so it
    /// used nothing but its request count.
    pub fn release(&mut self, now: Instant, ticket: u64) -> Option<(UsageKey, UsageTotals)> {
        self.settle(now, ticket, TokenUse::default())
    }

    fn end_in_flight(&mut self, now: Instant, reservation: &Reservation) {
        for subject in &reservation.in_flight {
            if let Some(n) = self.in_flight.get_mut(subject) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.in_flight.remove(subject);
                }
            }
            if let Some(slots) = self.slots.get_mut(subject) {
                slots.last_used = Some(now);
            }
            self.adjust_slots(now, subject);
        }
    }

    /// This Edge's requests in flight of `subject`.
    pub fn in_flight(&self, subject: &Subject) -> u64 {
        self.in_flight.get(subject).copied().unwrap_or(0)
    }

    /// The slots of `subject`'s concurrency limit the store last said this
    /// Edge holds.
    pub fn slots_held(&self, subject: &Subject) -> u64 {
        self.slots.get(subject).map_or(0, |s| s.granted)
    }

    /// The Edge is stopping (`unix_ms` on the wall clock), its
    /// requests drained (R-TEN-1, R-TEN-2, R-TEN-3): give back what it
    /// holds, so other Edges get it at once.
    ///
    /// * Every concurrency slot: a [`TenantsOutput::HoldSlots`] of nothing
    ///   per subject it holds slots of, instead of when its lease lapses
    ///   (one whose ask is on its way gives back once that is answered).
    /// * The unused rest of every window's chunks (requests, tokens,
    ///   spend): a [`TenantsOutput::GiveBack`] per counter of what it was
    ///   granted beyond what it used, reservations of requests still in
    ///   flight counted as used (a request in flight keeps what it needs;
    ///   a durable one left to a takeover stays counted, as a dead Edge's
    ///   does). One whose claim is on its way gives back once the claim
    ///   is answered; a minute already over gives back nothing. What is
    ///   given back is no longer this Edge's to use. The store applies
    ///   each at most once ([`check_give_back`]), so a failed one is sent
    ///   again, [`GIVE_BACK_RETRY_MS`] later, up to [`MAX_GIVE_BACK_ASKS`]
    ///   times.
    ///
    /// From then on it asks for nothing more: no slot, no further chunk
    /// of a window, no admission on credit of a slot.
    /// [`Self::handed_back`] says when the store has answered everything.
    pub fn hand_back(&mut self, unix_ms: u64) {
        if self.stopping {
            return;
        }
        self.stopping = true;
        self.stopped_unix_ms = unix_ms;
        let held: Vec<Subject> = self
            .slots
            .iter()
            .filter(|(_, s)| s.granted > 0 && s.asking.is_none())
            .map(|(subject, _)| subject.clone())
            .collect();
        for subject in held {
            let limit = self.slots.get(&subject).map_or(0, |s| s.limit);
            self.ask_back(&subject, limit);
        }
        let windows: Vec<CounterKey> = self.holdings.keys().cloned().collect();
        for key in windows {
            self.give_back(&key);
        }
    }

    /// Stopping: give back what this Edge holds of `key` and has not used,
    /// once, unless a claim of it is on its way (then once it is
    /// answered) or its window is over.
    fn give_back(&mut self, key: &CounterKey) {
        if !self.stopping || self.giving_back.contains_key(key) {
            return;
        }
        let Some(holding) = self.holdings.get_mut(key) else {
            return;
        };
        if holding.claiming.is_some() || window_over(key, self.stopped_unix_ms) {
            return;
        }
        let amount = holding.granted.saturating_sub(holding.used);
        if amount == 0 {
            return;
        }
        // No longer this Edge's to use, whatever the store answers.
        holding.granted -= amount;
        self.giving_back.insert(
            key.clone(),
            GivingBack {
                amount,
                asking: true,
                asks: 1,
                next_ask: None,
                done: false,
            },
        );
        self.outputs.push_back(TenantsOutput::GiveBack {
            counter: key.clone(),
            amount,
        });
    }

    /// The store answered a [`TenantsOutput::GiveBack`].
    fn gave_back(&mut self, now: Instant, counter: &CounterKey, outcome: Option<GiveBackOutcome>) {
        let Some(giving) = self.giving_back.get_mut(counter) else {
            return;
        };
        if !giving.asking {
            return;
        }
        giving.asking = false;
        match outcome {
            Some(outcome) => {
                giving.done = true;
                self.store_down.remove(&counter.subject);
                let freed = match outcome {
                    GiveBackOutcome::Freed(n) => n,
                    // A retry: an earlier send was applied (what it freed
                    // is taken as asked).
                    GiveBackOutcome::AlreadyGivenBack => giving.amount,
                    GiveBackOutcome::Full | GiveBackOutcome::WindowOver => 0,
                };
                *self.given_back.entry(counter.meter).or_default() += freed;
            }
            None if giving.asks < MAX_GIVE_BACK_ASKS => {
                giving.next_ask =
                    Some(now.saturating_add(Duration::from_millis(GIVE_BACK_RETRY_MS)));
            }
            None => giving.done = true,
        }
    }

    /// Send again the give-backs that failed and are due at `now`.
    fn retry_give_backs(&mut self, now: Instant) {
        for (counter, giving) in &mut self.giving_back {
            if giving.done || giving.asking || giving.next_ask.is_none_or(|t| now < t) {
                continue;
            }
            giving.asking = true;
            giving.asks += 1;
            giving.next_ask = None;
            self.outputs.push_back(TenantsOutput::GiveBack {
                counter: counter.clone(),
                amount: giving.amount,
            });
        }
    }

    /// Whether this Edge, stopping ([`Self::hand_back`]), is done giving
    /// back: it holds no slot and has no ask on its way (its last ask
    /// failed: then its lease lapses), no claim is on its way, and every
    /// window's give-back was answered (or failed [`MAX_GIVE_BACK_ASKS`]
    /// times: then that allowance stays claimed until its window ends).
    pub fn handed_back(&self) -> bool {
        self.stopping
            && self
                .slots
                .values()
                .all(|s| s.granted == 0 && s.asking.is_none())
            && self.holdings.values().all(|h| h.claiming.is_none())
            && self.giving_back.values().all(|g| g.done)
    }

    /// What the store freed of this Edge's give-backs so far, per meter
    /// (requests, tokens, spend in micro-units), for the stop's log line
    /// and `/status`.
    pub fn given_back(&self) -> &BTreeMap<Meter, u64> {
        &self.given_back
    }

    /// Ask the store to hold none of `subject`'s slots for this Edge.
    fn ask_back(&mut self, subject: &Subject, limit: u64) {
        let Some(slots) = self.slots.get_mut(subject) else {
            return;
        };
        slots.asking = Some(0);
        slots.next_ask = None;
        self.outputs.push_back(TenantsOutput::HoldSlots {
            counter: Self::slot_counter(subject),
            want: 0,
            limit,
            lease_ms: self.cfg.slot_lease_ms,
        });
    }

    /// The slots of every concurrency limit the store last said this Edge
    /// holds, summed (for `/status`).
    pub fn slots_held_total(&self) -> u64 {
        self.slots.values().map(|s| s.granted).sum()
    }

    /// The gauge of `subject`'s concurrency limit.
    pub fn slot_counter(subject: &Subject) -> CounterKey {
        CounterKey {
            subject: subject.clone(),
            meter: Meter::Slots,
            window_unix_ms: 0,
        }
    }

    /// Whether one more request of `subject` (concurrency limit `limit`)
    /// fits now (R-TEN-1 across Edges): within the slots this Edge holds,
    /// plus one chunk on credit unless the store just said the limit is
    /// full; with the store down, within this Edge's local share.
    fn slot_fits(&self, now: Instant, subject: &Subject, limit: u64) -> bool {
        let n = self.in_flight(subject);
        if n >= limit {
            return false;
        }
        #[cfg(feature = "planted-bugs")]
        if self.planted.has(PlantedBug::ConcurrencyPerEdge) {
            return true;
        }
        if self.store_down.contains(subject) {
            let share = ((limit as f64 * self.cfg.local_share) as u64).max(1);
            return n < share;
        }
        let slots = self.slots.get(subject);
        // While a smaller holding is asked for, only that is counted on.
        let granted = slots.map_or(0, |s| s.granted.min(s.asking.unwrap_or(u64::MAX)));
        let full = slots.and_then(|s| s.full_until).is_some_and(|t| now < t);
        let credit = if full || self.stopping {
            0
        } else {
            self.chunk(limit)
        };
        n < granted + credit
    }

    /// A request of `subject` took a slot: keep the holding a chunk ahead.
    fn slot_used(&mut self, now: Instant, subject: &Subject, limit: u64) {
        let slots = self.slots.entry(subject.clone()).or_default();
        slots.limit = if slots.limit == 0 {
            limit
        } else {
            slots.limit.min(limit)
        };
        slots.last_used = Some(now);
        self.adjust_slots(now, subject);
    }

    /// Ask for the slots `subject` needs now (`more`: one beyond those in
    /// flight, for a request that did not fit), unless an ask is on its
    /// way (then: it is coming, `true`) or the store just said the limit
    /// is full (`false`). With the store taken as down the ask still goes
    /// out: it is how the Edge learns the store is back.
    fn ask_slots(&mut self, now: Instant, subject: &Subject, limit: u64, more: bool) -> bool {
        let n = self.in_flight(subject);
        let chunk = self.chunk(limit);
        let slots = self.slots.entry(subject.clone()).or_default();
        slots.limit = if slots.limit == 0 {
            limit
        } else {
            slots.limit.min(limit)
        };
        if slots.asking.is_some() {
            return true;
        }
        if self.stopping {
            return false;
        }
        if more && (n >= slots.limit || slots.full_until.is_some_and(|t| now < t)) {
            return false;
        }
        let want = (n + chunk).max(n + u64::from(more)).min(slots.limit);
        slots.asking = Some(want);
        self.outputs.push_back(TenantsOutput::HoldSlots {
            counter: Self::slot_counter(subject),
            want,
            limit: slots.limit,
            lease_ms: self.cfg.slot_lease_ms,
        });
        true
    }

    /// Keep `subject`'s holding one chunk ahead of its requests in flight:
    /// while some are in flight, ask for more when less than half a chunk
    /// is spare (unless the store just said the limit is full); give back
    /// what is beyond one chunk.
    fn adjust_slots(&mut self, now: Instant, subject: &Subject) {
        let n = self.in_flight(subject);
        let Some(slots) = self.slots.get(subject) else {
            return;
        };
        if slots.asking.is_some() || slots.limit == 0 {
            return;
        }
        if self.stopping {
            // Stopping: everything goes back, whatever is in flight (its
            // requests end with this process; a takeover counts a durable
            // one again where it continues).
            if slots.granted > 0 {
                let limit = slots.limit;
                self.ask_back(subject, limit);
            }
            return;
        }
        let chunk = self.chunk(slots.limit);
        let target = (n + chunk).min(slots.limit);
        let spare = slots.granted.saturating_sub(n);
        let full = slots.full_until.is_some_and(|t| now < t);
        if (n > 0 && slots.granted < target && spare * 2 < chunk && !full) || slots.granted > target
        {
            let limit = slots.limit;
            if let Some(s) = self.slots.get_mut(subject) {
                s.asking = Some(target);
            }
            self.outputs.push_back(TenantsOutput::HoldSlots {
                counter: Self::slot_counter(subject),
                want: target,
                limit,
                lease_ms: self.cfg.slot_lease_ms,
            });
        }
    }

    /// The store answered a [`TenantsOutput::HoldSlots`].
    fn slots_answered(&mut self, now: Instant, subject: &Subject, held: Option<u64>) {
        let renew = Duration::from_millis((self.cfg.slot_lease_ms / 3).max(1));
        let Some(slots) = self.slots.get_mut(subject) else {
            return;
        };
        let asked = slots.asking.take();
        match held {
            Some(held) => {
                self.store_down.remove(subject);
                if asked.is_some_and(|want| held < want) {
                    slots.full_until =
                        Some(now.saturating_add(Duration::from_millis(SLOTS_FULL_MS)));
                }
                slots.granted = held;
                slots.next_ask = (held > 0).then(|| now.saturating_add(renew));
            }
            None => {
                self.store_down.insert(subject.clone());
                // The ask may have been written: a smaller holding asked
                // for is all that is counted on.
                if let Some(want) = asked {
                    slots.granted = slots.granted.min(want);
                }
                // Asked again soon: the lease must not lapse while this
                // Edge holds slots.
                slots.next_ask =
                    Some(now.saturating_add(Duration::from_millis(SLOTS_FULL_MS).min(renew)));
            }
        }
        self.adjust_slots(now, subject);
    }

    /// Renew the leases due at `now`; an idle holding (nothing in flight
    /// for a third of the lease) gives its slots back; a holding of
    /// nothing is forgotten.
    fn renew_slots(&mut self, now: Instant) {
        let idle = Duration::from_millis((self.cfg.slot_lease_ms / 3).max(1));
        let due: Vec<Subject> = self
            .slots
            .iter()
            .filter(|(_, s)| s.asking.is_none() && s.next_ask.is_some_and(|t| now >= t))
            .map(|(subject, _)| subject.clone())
            .collect();
        for subject in due {
            let n = self.in_flight(&subject);
            let Some(slots) = self.slots.get_mut(&subject) else {
                continue;
            };
            let idle = n == 0
                && slots
                    .last_used
                    .is_none_or(|t| now >= t.saturating_add(idle));
            let want = if idle || self.stopping {
                0
            } else {
                slots.granted.max(n)
            };
            slots.asking = Some(want);
            slots.next_ask = None;
            self.outputs.push_back(TenantsOutput::HoldSlots {
                counter: Self::slot_counter(&subject),
                want,
                limit: slots.limit,
                lease_ms: self.cfg.slot_lease_ms,
            });
        }
        let in_flight = &self.in_flight;
        self.slots.retain(|subject, s| {
            s.asking.is_some() || s.granted > 0 || in_flight.contains_key(subject)
        });
    }

    /// What this Edge knows of `subject`'s `meter` (requests or tokens)
    /// this minute, for the `x-ratelimit-*` headers; `None` without a
    /// limit.
    pub fn rate_state(
        &self,
        subject: &Subject,
        meter: Meter,
        limit: Option<u64>,
        unix_ms: u64,
    ) -> Option<RateState> {
        let limit = limit?;
        let minute = unix_ms - unix_ms % MINUTE_MS;
        let key = CounterKey {
            subject: subject.clone(),
            meter,
            window_unix_ms: minute,
        };
        let used = self.holdings.get(&key).map_or(0, |h| h.used);
        Some(RateState {
            limit,
            remaining: limit.saturating_sub(used),
            reset_ms: minute + MINUTE_MS - unix_ms,
        })
    }

    /// The tightest of the rates that apply to `request` for `meter`
    /// (requests or tokens) this minute (the one with the least left): the
    /// key's, the principal's and each one's for the request's model, for
    /// the `x-ratelimit-*` headers (R-TEN-1).
    pub fn tighter_rate(&self, request: &AdmitRequest, meter: Meter) -> Option<RateState> {
        request
            .applicable()
            .into_iter()
            .filter_map(|(subject, limits)| {
                let limit = match meter {
                    Meter::Requests => limits.requests_per_minute(),
                    Meter::Tokens => limits.tokens_per_minute(),
                    Meter::Spend | Meter::JournalBytes | Meter::Background | Meter::Slots => None,
                };
                self.rate_state(&subject, meter, limit, request.unix_ms)
            })
            .min_by_key(|s| s.remaining)
    }

    /// The `x-ratelimit-*` state of a refused `request` for `meter`
    /// (R-TEN-1): as [`Self::tighter_rate`], but the refusing limit's
    /// remaining is what this Edge could admit of it now, so a 429 never
    /// shows room it could not give (refused while a claim is on its way,
    /// the window may have room this Edge does not hold yet).
    pub fn refused_rate(
        &self,
        request: &AdmitRequest,
        meter: Meter,
        refusal: &Refusal,
    ) -> Option<RateState> {
        let minute = request.unix_ms - request.unix_ms % MINUTE_MS;
        request
            .applicable()
            .into_iter()
            .filter_map(|(subject, limits)| {
                let limit = match meter {
                    Meter::Requests => limits.requests_per_minute(),
                    Meter::Tokens => limits.tokens_per_minute(),
                    Meter::Spend | Meter::JournalBytes | Meter::Background | Meter::Slots => None,
                };
                let mut state = self.rate_state(&subject, meter, limit, request.unix_ms)?;
                if subject == refusal.subject && refusal.meter == Some(meter) {
                    let key = CounterKey {
                        subject,
                        meter,
                        window_unix_ms: minute,
                    };
                    state.remaining = state.remaining.min(self.admissible(&key, state.limit));
                }
                Some(state)
            })
            .min_by_key(|s| s.remaining)
    }

    /// How much of `key` (limit `limit`) this Edge could admit now
    /// ([`Self::fits`]' rule as an amount).
    fn admissible(&self, key: &CounterKey, limit: u64) -> u64 {
        let holding = self.holdings.get(key);
        let (granted, used, exhausted) =
            holding.map_or((0, 0, false), |h| (h.granted, h.used, h.exhausted));
        if self.store_down.contains(&key.subject) {
            if key.meter == Meter::Spend {
                return granted.saturating_sub(used);
            }
            let share = ((limit as f64 * self.cfg.local_share) as u64).max(1);
            let local = self.local.get(key).copied().unwrap_or(0);
            return share.saturating_sub(local);
        }
        let credit = if exhausted { 0 } else { self.chunk(limit) };
        (granted + credit).saturating_sub(used).min(limit)
    }

    /// Feed one input at `now`; drain [`Self::poll_output`] after.
    pub fn handle_input(&mut self, now: Instant, input: TenantsInput) {
        match input {
            TenantsInput::Claimed { counter, granted } => {
                let Some(holding) = self.holdings.get_mut(&counter) else {
                    return;
                };
                holding.claiming = None;
                match granted {
                    Some(granted) => {
                        self.store_down.remove(&counter.subject);
                        holding.granted += granted;
                        if granted == 0 {
                            holding.exhausted = true;
                        }
                        holding.last_used = Some(now);
                        self.claim_more(&counter);
                    }
                    None => {
                        self.store_down.insert(counter.subject.clone());
                    }
                }
                // Stopping: what the claim brought goes back with the rest.
                self.give_back(&counter);
            }
            TenantsInput::SlotsHeld { counter, held } => {
                self.slots_answered(now, &counter.subject, held);
            }
            TenantsInput::GaveBack { counter, outcome } => {
                self.gave_back(now, &counter, outcome);
            }
        }
    }

    /// The next output, in order.
    pub fn poll_output(&mut self) -> Option<TenantsOutput> {
        self.outputs.pop_front()
    }

    /// When windows this Edge no longer uses may be forgotten, or a
    /// lease on slots is to be renewed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let forget = self
            .holdings
            .values()
            .filter(|h| h.claiming.is_none())
            .filter_map(|h| h.last_used)
            .min()
            .map(|at| at.saturating_add(FORGET_AFTER));
        let renew = self
            .slots
            .values()
            .filter(|s| s.asking.is_none())
            .filter_map(|s| s.next_ask)
            .min();
        let give_back = self
            .giving_back
            .values()
            .filter(|g| !g.done && !g.asking)
            .filter_map(|g| g.next_ask)
            .min();
        crate::time::earliest(crate::time::earliest(forget, renew), give_back)
    }

    /// Forget the windows unused for three minutes (`FORGET_AFTER`; none with a
    /// reservation held, nor a budget in total).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.renew_slots(now);
        self.retry_give_backs(now);
        let reserved: BTreeSet<&CounterKey> = self
            .reservations
            .values()
            .flat_map(|r| r.held.iter().map(|(k, _)| k))
            .collect();
        let stale: Vec<CounterKey> = self
            .holdings
            .iter()
            .filter(|(k, h)| {
                k.window_unix_ms != 0
                    && h.claiming.is_none()
                    && !reserved.contains(k)
                    && h.last_used
                        .is_some_and(|at| now >= at.saturating_add(FORGET_AFTER))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in stale {
            self.holdings.remove(&key);
            self.local.remove(&key);
        }
    }
}

#[cfg(test)]
mod test_world;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod attempt_tests;

#[cfg(test)]
mod model_tests;

#[cfg(test)]
mod give_back_tests;
