//! What the Node's exact-target health probe found, classified once for
//! every path that reports it: the stall watchdog's probe (R-WD-5) and the
//! `Capabilities` answer (R-CAP-1, R-HT-1).
//!
//! The shell runs the probe (the adapter's cheapest real liveness call)
//! and turns its answer into [`ProbeEvidence`]; the rules here decide what
//! that answer means for the target being probed:
//!
//! * a target whose credential the Edge manages ([`TargetCredential::Managed`])
//!   is probed without any credential, because the Node holds none (the
//!   secret arrives only as a per-run lease, R-CRED-1, R-CRED-2). An
//!   authentication refusal then proves the server is up and answering, so
//!   it counts as available; the credential itself is checked on every run
//!   by the lease path (R-CRED-3);
//! * every other answer keeps its meaning, and the watchdog reads it
//!   fail-closed ([`ProbeEvidence::outcome`], R-WD-5).

use iop_wire::{HealthFailureCode, ProviderHealth};

use crate::node::watchdog::ProbeOutcome;

/// Where the credential of a probed target comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TargetCredential {
    /// The Node calls the target with its own standing key, or with none
    /// because the target needs none: the probe goes out like a run.
    Standing,
    /// The Edge manages the credential and seals it into a lease per
    /// dispatch (R-CRED-1); the Node holds no secret, so the probe goes
    /// out without one.
    Managed,
}

/// One exact-target probe's answer: the target's health and, when it is not
/// available, the sanitized reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProbeEvidence {
    /// Available, unavailable or unknown.
    pub health: ProviderHealth,
    /// Why, when not available (`None` when the reason is not known).
    pub failure: Option<HealthFailureCode>,
}

impl ProbeEvidence {
    /// The probe's answer as the adapter gave it.
    pub const fn new(health: ProviderHealth, failure: Option<HealthFailureCode>) -> Self {
        Self { health, failure }
    }

    /// What the answer means for a target whose credential comes from
    /// `credential`.
    ///
    /// A managed target's authentication refusal (HTTP 401,
    /// [`HealthFailureCode::AuthenticationFailed`]) is available with no
    /// failure: the probe carried no credential, so the refusal only shows
    /// that the server answers. Everything else is unchanged, including an
    /// authorization refusal (HTTP 403) of a managed target and any refusal
    /// of a target with a standing credential, which really lacks a valid
    /// key.
    pub fn for_target(self, credential: TargetCredential) -> Self {
        match (credential, self.health, self.failure) {
            (
                TargetCredential::Managed,
                ProviderHealth::Unavailable,
                Some(HealthFailureCode::AuthenticationFailed),
            ) => Self::new(ProviderHealth::Available, None),
            _ => self,
        }
    }

    /// The stall watchdog's view of the answer (R-WD-5): available is a
    /// healthy verdict, unavailable an unhealthy one with its reason, and
    /// unknown no verdict at all (fail closed).
    pub fn outcome(self) -> ProbeOutcome {
        match self.health {
            ProviderHealth::Available => ProbeOutcome::Healthy,
            ProviderHealth::Unavailable => ProbeOutcome::Unhealthy(self.failure),
            ProviderHealth::Unknown => ProbeOutcome::Failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MANAGED: TargetCredential = TargetCredential::Managed;
    const STANDING: TargetCredential = TargetCredential::Standing;

    fn unavailable(code: HealthFailureCode) -> ProbeEvidence {
        ProbeEvidence::new(ProviderHealth::Unavailable, Some(code))
    }

    fn available() -> ProbeEvidence {
        ProbeEvidence::new(ProviderHealth::Available, None)
    }

    #[test]
    fn managed_target_answering_401_to_a_credential_less_probe_is_available() {
        let evidence = unavailable(HealthFailureCode::AuthenticationFailed).for_target(MANAGED);
        assert_eq!(evidence, available());
        assert_eq!(evidence.outcome(), ProbeOutcome::Healthy);
    }

    #[test]
    fn standing_credential_target_answering_401_is_unavailable_authentication_failed() {
        let evidence = unavailable(HealthFailureCode::AuthenticationFailed).for_target(STANDING);
        assert_eq!(
            evidence,
            unavailable(HealthFailureCode::AuthenticationFailed)
        );
        assert_eq!(
            evidence.outcome(),
            ProbeOutcome::Unhealthy(Some(HealthFailureCode::AuthenticationFailed))
        );
    }

    #[test]
    fn managed_target_answering_403_stays_unavailable_authorization_failed() {
        for credential in [MANAGED, STANDING] {
            assert_eq!(
                unavailable(HealthFailureCode::AuthorizationFailed).for_target(credential),
                unavailable(HealthFailureCode::AuthorizationFailed)
            );
        }
    }

    #[test]
    fn only_an_authentication_refusal_is_reclassified_for_a_managed_target() {
        for &code in HealthFailureCode::ALL {
            for &health in ProviderHealth::ALL {
                for failure in [None, Some(code)] {
                    let answer = ProbeEvidence::new(health, failure);
                    assert_eq!(answer.for_target(STANDING), answer, "{answer:?}");
                    let reclassified = health == ProviderHealth::Unavailable
                        && failure == Some(HealthFailureCode::AuthenticationFailed);
                    let expected = if reclassified { available() } else { answer };
                    assert_eq!(answer.for_target(MANAGED), expected, "{answer:?}");
                }
            }
        }
    }

    #[test]
    fn managed_target_that_is_unreachable_or_unknown_stays_so() {
        assert_eq!(
            unavailable(HealthFailureCode::TransportFailed).for_target(MANAGED),
            unavailable(HealthFailureCode::TransportFailed)
        );
        let timeout = ProbeEvidence::new(ProviderHealth::Unknown, Some(HealthFailureCode::Timeout));
        assert_eq!(timeout.for_target(MANAGED), timeout);
        assert_eq!(timeout.for_target(MANAGED).outcome(), ProbeOutcome::Failed);
    }

    #[test]
    fn outcome_follows_r_wd_5_fail_closed() {
        assert_eq!(available().outcome(), ProbeOutcome::Healthy);
        assert_eq!(
            unavailable(HealthFailureCode::Http5xx).outcome(),
            ProbeOutcome::Unhealthy(Some(HealthFailureCode::Http5xx))
        );
        assert_eq!(
            ProbeEvidence::new(ProviderHealth::Unavailable, None).outcome(),
            ProbeOutcome::Unhealthy(None)
        );
        assert_eq!(
            ProbeEvidence::new(ProviderHealth::Unknown, Some(HealthFailureCode::Timeout)).outcome(),
            ProbeOutcome::Failed
        );
    }
}
