//! Tenants' limits and budgets at the Edge (SPEC §9): this module drives
//! [`iop_core::tenant::Tenants`], which decides every admission,
//! reservation and settlement (R-TEN-1, R-TEN-2, R-TEN-3). It asks the
//! machine at admission (a direct answer: nothing waits on a store),
//! carries its claims to the counter store, and settles each request when
//! its [`TenantHold`] is dropped, with the usage its driver saw.
//!
//! The counter store here is this Edge's own (one Edge, or Edges whose
//! limits are each their own); a store shared by Edges answers the same
//! claims with the same rule ([`iop_core::tenant::check_claim`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use iop_core::tenant::{
    AdmitRequest, CounterKey, Limits, Meter, Price, Refusal, RefusalKind, Subject, Tenants,
    TenantsConfig, TenantsInput, TenantsOutput, TokenUse, check_claim,
};
use iop_transport::clock::Clock;

/// The Edge's tenants.
pub struct Tenancy {
    machine: Mutex<Tenants>,
    /// The claimed total of each counter (this Edge's counter store).
    claimed: Mutex<BTreeMap<CounterKey, u64>>,
    clock: Clock,
    tickets: AtomicU64,
    default_max_output_tokens: u64,
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
    used: Mutex<Option<TokenUse>>,
    /// Its rate headers.
    pub headers: RateHeaders,
}

impl TenantHold {
    /// The usage the request's answer reported so far (summed over its
    /// attempts by the request machine).
    pub fn record(&self, usage: &iop_wire::Usage) {
        *self.used.lock().unwrap_or_else(|e| e.into_inner()) = Some(TokenUse {
            input: usage.prompt_tokens,
            cached_input: 0,
            output: usage.completion_tokens,
        });
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
        let used = self.used.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.tenancy.settle(self.ticket, used);
    }
}

impl Tenancy {
    /// The tenants of an Edge.
    pub fn new(config: TenantsConfig, clock: Clock, default_max_output_tokens: u64) -> Self {
        Tenancy {
            machine: Mutex::new(Tenants::new(config)),
            claimed: Mutex::new(BTreeMap::new()),
            clock,
            tickets: AtomicU64::new(1),
            default_max_output_tokens,
        }
    }

    /// Admit a request of `key` (its principal's limits `principal`) for a
    /// model priced `price`, whose body is `body_bytes` long (its prompt's
    /// tokens are at most that) and that asks for at most `max_output`
    /// tokens. Refused: which limit, and when to try again.
    #[allow(clippy::too_many_arguments)]
    pub fn admit(
        self: &Arc<Self>,
        key_id: &str,
        key_limits: &Limits,
        principal: &str,
        principal_limits: &Limits,
        price: Option<Price>,
        body_bytes: u64,
        max_output: Option<u64>,
    ) -> Result<Option<TenantHold>, crate::api::ApiError> {
        let limited = |l: &Limits| {
            l.requests_per_minute.is_some()
                || l.tokens_per_minute.is_some()
                || l.concurrent_requests.is_some()
                || l.budget.is_some()
        };
        if !limited(key_limits) && !limited(principal_limits) {
            return Ok(None);
        }
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let unix_ms = iop_transport::clock::unix_ms();
        let request = AdmitRequest {
            ticket,
            key: key_id.to_owned(),
            principal: principal.to_owned(),
            key_limits: key_limits.clone(),
            principal_limits: principal_limits.clone(),
            price,
            prompt_tokens_max: body_bytes,
            output_tokens_max: max_output.unwrap_or(self.default_max_output_tokens),
            unix_ms,
            model: String::new(),
            durable: false,
            background: false,
            key_held: Default::default(),
            principal_held: Default::default(),
        };
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let admitted = machine.admit(self.clock.now(), &request);
        self.drain(&mut machine);
        // The tighter of the key's and the principal's, as this Edge
        // knows them.
        let state = |meter: Meter, limit: fn(&Limits) -> Option<u64>| {
            machine
                .tighter_rate(&request, meter, limit)
                .map(|s| (s.limit, s.remaining, s.reset_ms))
        };
        let headers = RateHeaders {
            requests: state(Meter::Requests, |l| l.requests_per_minute),
            tokens: state(Meter::Tokens, |l| l.tokens_per_minute),
        };
        drop(machine);
        if let Err(refusal) = admitted {
            let mut err = refusal_error(&refusal);
            let mut map = HeaderMap::new();
            headers.apply(&mut map);
            err.headers = map
                .iter()
                .filter_map(|(n, v)| Some((n.to_string(), v.to_str().ok()?.to_owned())))
                .collect();
            return Err(err);
        }
        Ok(Some(TenantHold {
            tenancy: self.clone(),
            ticket,
            used: Mutex::new(None),
            headers,
        }))
    }

    fn settle(&self, ticket: u64, used: Option<TokenUse>) {
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        match used {
            Some(used) => machine.settle(now, ticket, used),
            None => machine.release(now, ticket),
        };
        machine.handle_timeout(now);
        self.drain(&mut machine);
    }

    /// Answer the machine's claims from this Edge's counters. Counters of
    /// windows that are over are dropped, so the store holds the current
    /// windows only (bounded by the configured keys and principals).
    fn drain(&self, machine: &mut Tenants) {
        let now = self.clock.now();
        let unix_ms = iop_transport::clock::unix_ms();
        {
            let mut claimed = self.claimed.lock().unwrap_or_else(|e| e.into_inner());
            claimed.retain(|key, _| match key.meter {
                Meter::Requests | Meter::Tokens | Meter::JournalBytes | Meter::Background => {
                    key.window_unix_ms + 2 * iop_core::tenant::MINUTE_MS > unix_ms
                }
                // A budget in total has window 0 and is kept; a day's or a
                // month's until it is over.
                Meter::Spend => {
                    key.window_unix_ms == 0
                        || key.window_unix_ms + 31 * iop_core::tenant::DAY_MS > unix_ms
                }
            });
        }
        while let Some(TenantsOutput::Claim {
            counter,
            amount,
            limit,
        }) = machine.poll_output()
        {
            let granted = {
                let mut claimed = self.claimed.lock().unwrap_or_else(|e| e.into_inner());
                let total = claimed.entry(counter.clone()).or_default();
                let (next, granted) = check_claim(*total, amount, limit);
                *total = next;
                granted
            };
            machine.handle_input(
                now,
                TenantsInput::Claimed {
                    counter,
                    granted: Some(granted),
                },
            );
        }
    }
}

/// The API error of a refusal: 429 `rate_limit_exceeded` or
/// `insufficient_quota`, with `Retry-After` when waiting helps.
fn refusal_error(refusal: &Refusal) -> crate::api::ApiError {
    let what = match (&refusal.subject, refusal.meter) {
        (Subject::Key(_), Some(m)) => format!("this key's {} limit", m.as_str()),
        (Subject::Principal(_), Some(m)) => format!("this principal's {} limit", m.as_str()),
        (Subject::Key(_), None) => "this key's limit of requests in flight".to_owned(),
        (Subject::Principal(_), None) => "this principal's limit of requests in flight".to_owned(),
    };
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
