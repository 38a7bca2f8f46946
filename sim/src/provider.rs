//! Simulated providers: what one provider call (one attempt) does, and what
//! an exact-target probe answers.
//!
//! A [`CallPlan`] is drawn when the Node starts the call. While faults are
//! on it may prefill for longer than the stall timeout, stall mid-stream,
//! hang, fail, answer HTTP 5xx before any content, or close abruptly; once
//! the call is canceled it returns within the close grace, after it, or
//! never (a late provider return). In the fault-free part of a run every
//! call is healthy and quick and every probe answers healthy.

use std::time::Duration;

use iop_core::node::watchdog::ProbeOutcome;
use iop_wire::{HealthFailureCode, ProviderHealth};

use crate::config::{HEALTHY_TOKENS_MAX, PPM, ProviderProfile, Rng};

/// The 5xx statuses a provider answers with ([`Ending::Http5xx`]).
pub const HTTP_5XX: [u16; 4] = [500, 502, 503, 504];

/// How a call ends if nothing cancels it first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// All tokens, then `Completed`.
    Complete,
    /// A provider error after the tokens.
    Error,
    /// An HTTP 5xx status (500, 502, 503 or 504) before any content: the
    /// call fails without a `Started`, as `iop-node`'s HTTP adapters report
    /// an error status (`provider_error` with the status, `http_5xx`
    /// health), and the node marks it retryable (R-FAIL-1).
    Http5xx(u16),
    /// The provider connection drops after the tokens.
    Abrupt,
    /// Emits `n` tokens, then nothing, ever (a mid-stream stall).
    StallAfter(u32),
    /// `Started`, then nothing, ever.
    Hang,
}

/// One provider call's script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallPlan {
    /// Until the provider accepts the request (`Started`).
    pub start_delay: Duration,
    /// From `Started` to the first token.
    pub prefill: Duration,
    /// Tokens before the ending.
    pub tokens: u32,
    /// Between tokens.
    pub token_gap: Duration,
    /// The ending.
    pub ending: Ending,
    /// After a cancel, how long the call takes to return (`None`: never).
    pub return_after_cancel: Option<Duration>,
    /// How long a cancel takes to reach the provider (late output may
    /// arrive meanwhile and is fenced, R-WD-6).
    pub cancel_latency: Duration,
}

impl CallPlan {
    /// A healthy call for a provider with this stall timeout: every gap is
    /// well under it.
    pub fn healthy(rng: &mut Rng, stall_timeout: Duration, close_grace: Duration) -> Self {
        let stall_ms = u64::try_from(stall_timeout.as_millis()).unwrap_or(1000);
        Self {
            start_delay: rng.millis(0, 10),
            prefill: rng.millis(1, (stall_ms / 3).max(2)),
            tokens: rng.range(1, u64::from(HEALTHY_TOKENS_MAX)) as u32,
            token_gap: rng.millis(1, (stall_ms / 4).clamp(2, 60)),
            ending: Ending::Complete,
            return_after_cancel: Some(within(rng, close_grace)),
            cancel_latency: rng.millis(0, 5),
        }
    }

    /// A call drawn from the seed's fault profile.
    pub fn faulty(
        rng: &mut Rng,
        profile: &ProviderProfile,
        stall_timeout: Duration,
        close_grace: Duration,
    ) -> Self {
        let mut plan = Self::healthy(rng, stall_timeout, close_grace);
        let stall_ms = u64::try_from(stall_timeout.as_millis()).unwrap_or(1000);
        if rng.chance(profile.slow_prefill_ppm) {
            // Sometimes just under, usually over the stall timeout.
            plan.prefill = rng.millis(stall_ms / 2, stall_ms * 3);
        }
        // A disabled fault draws nothing, so worlds without 5xx keep their
        // calls.
        plan.ending = if rng.chance(profile.http_5xx_ppm) {
            Ending::Http5xx(HTTP_5XX[rng.index(HTTP_5XX.len())])
        } else if rng.chance(profile.hang_ppm) {
            Ending::Hang
        } else if rng.chance(profile.stall_ppm) {
            Ending::StallAfter(rng.range(0, u64::from(plan.tokens)) as u32)
        } else if rng.chance(profile.error_ppm) {
            plan.tokens = rng.range(0, u64::from(plan.tokens)) as u32;
            Ending::Error
        } else if rng.chance(profile.abrupt_ppm) {
            plan.tokens = rng.range(0, u64::from(plan.tokens)) as u32;
            Ending::Abrupt
        } else {
            Ending::Complete
        };
        plan.return_after_cancel = if rng.chance(profile.return_within_grace_ppm) {
            Some(within(rng, close_grace))
        } else if rng.chance(profile.never_return_ppm) {
            None
        } else {
            let grace_ms = u64::try_from(close_grace.as_millis()).unwrap_or(1000);
            Some(rng.millis(grace_ms + 1, grace_ms * 3 + 10))
        };
        plan.cancel_latency = rng.millis(0, 20);
        plan
    }
}

fn within(rng: &mut Rng, grace: Duration) -> Duration {
    let grace_us = u64::try_from(grace.as_micros()).unwrap_or(1);
    Duration::from_micros(rng.range(0, grace_us.saturating_sub(1)))
}

/// What a probe (the watchdog's exact-target probe or a CAPABILITIES check)
/// answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeAnswer {
    /// Healthy.
    Healthy,
    /// Unhealthy.
    Unhealthy,
    /// The probe errored.
    Error,
    /// No answer before the bound.
    Timeout,
}

impl ProbeAnswer {
    /// Draw an answer from the profile (faults on) or healthy (faults off).
    pub fn draw(rng: &mut Rng, profile: &ProviderProfile, faults_on: bool) -> Self {
        if !faults_on || rng.chance(profile.probe_ok_ppm) {
            return ProbeAnswer::Healthy;
        }
        if rng.chance(profile.probe_unhealthy_ppm) {
            ProbeAnswer::Unhealthy
        } else if rng.chance(profile.probe_error_ppm) {
            ProbeAnswer::Error
        } else if rng.chance(PPM / 2) {
            ProbeAnswer::Timeout
        } else {
            ProbeAnswer::Healthy
        }
    }

    /// The watchdog's view (`None`: no answer, the probe bound decides).
    pub fn outcome(self) -> Option<ProbeOutcome> {
        match self {
            ProbeAnswer::Healthy => Some(ProbeOutcome::Healthy),
            ProbeAnswer::Unhealthy => {
                Some(ProbeOutcome::Unhealthy(Some(HealthFailureCode::Http5xx)))
            }
            ProbeAnswer::Error => Some(ProbeOutcome::Failed),
            ProbeAnswer::Timeout => None,
        }
    }

    /// The CAPABILITIES view of the same answer (R-CAP-1).
    pub fn health(self) -> ProviderHealth {
        match self {
            ProbeAnswer::Healthy => ProviderHealth::Available,
            ProbeAnswer::Unhealthy => ProviderHealth::Unavailable,
            ProbeAnswer::Error | ProbeAnswer::Timeout => ProviderHealth::Unknown,
        }
    }
}
