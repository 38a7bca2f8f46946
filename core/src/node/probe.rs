//! What the Node's exact-target health probe found, classified once for
//! every path that reports it: the stall watchdog's probe (R-WD-5) and the
//! `Capabilities` answer (R-CAP-1, R-HT-1).
//!
//! The shell runs the probe (the adapter's cheapest real liveness call)
//! and reports how it ended as a [`ProbeAnswer`]; the rules here decide what
//! that means:
//!
//! * [`ProbeEvidence::classify`]: only an answer from the target is a
//!   verdict. A valid model list is available; an error status (or a
//!   built-in target's own unhealthy report) is unavailable with its
//!   sanitized reason. A probe that got no verdict (its bound passed, the
//!   transport failed, the answer could not be read) is unknown, carrying
//!   the code of what went wrong (R-WD-5: probe error or timeout ->
//!   `unknown/health_unknown`);
//! * a target whose credential the Edge manages ([`TargetCredential::Managed`])
//!   is probed without any credential, because the Node holds none (the
//!   secret arrives only as a per-run lease, R-CRED-1, R-CRED-2). An
//!   authentication refusal then proves the server is up and answering, so
//!   it counts as available; the credential itself is checked on every run
//!   by the lease path (R-CRED-3);
//! * every other answer keeps its meaning, and the watchdog reads it
//!   fail-closed ([`ProbeEvidence::outcome`], R-WD-5).

use iop_wire::{AdapterKind, HealthFailureCode, ProbeTarget, ProviderHealth};

use crate::edge::health::classify_http_status;
use crate::node::watchdog::ProbeOutcome;

/// How one exact-target probe ended, as the shell saw it. The shell only
/// reports what happened; [`ProbeEvidence::classify`] decides what it means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProbeAnswer {
    /// The target answered with a valid model list, empty or not (R-HT-2).
    Models,
    /// The target answered with this HTTP status, not a success.
    HttpStatus(u16),
    /// A target reached without HTTP (the built-in mock, an adapter without
    /// a base URL) reported itself unhealthy for this reason.
    Unhealthy(HealthFailureCode),
    /// The probe's bound passed before the answer was complete.
    TimedOut,
    /// The transport failed before or during the answer (connect, TLS,
    /// reset).
    TransportFailed,
    /// An answer arrived but was not a model list (undecodable, too large).
    Malformed,
}

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
    /// A probe's evidence as already classified (e.g. read back from a
    /// verdict the shell carries).
    pub const fn new(health: ProviderHealth, failure: Option<HealthFailureCode>) -> Self {
        Self { health, failure }
    }

    /// What a probe's ending means (R-WD-5, fail closed): only an answer
    /// from the target is a verdict. A probe error or timeout is `unknown`
    /// with the code of what went wrong, which the Edge's health tracker
    /// still counts as a failed refresh probe (R-HT-1).
    pub fn classify(answer: ProbeAnswer) -> Self {
        let unknown = |code| Self::new(ProviderHealth::Unknown, Some(code));
        match answer {
            ProbeAnswer::Models => Self::new(ProviderHealth::Available, None),
            ProbeAnswer::HttpStatus(status) => match classify_http_status(status) {
                Some(code) => Self::new(ProviderHealth::Unavailable, Some(code)),
                // A success status without a model list is no verdict.
                None => unknown(HealthFailureCode::MalformedResponse),
            },
            ProbeAnswer::Unhealthy(code) => Self::new(ProviderHealth::Unavailable, Some(code)),
            ProbeAnswer::TimedOut => unknown(HealthFailureCode::Timeout),
            ProbeAnswer::TransportFailed => unknown(HealthFailureCode::TransportFailed),
            ProbeAnswer::Malformed => unknown(HealthFailureCode::MalformedResponse),
        }
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

/// Whether a `Capabilities` command asking about `filter` probes the
/// node's (`adapter`, `target`) (R-CAP-1): exactly that adapter and target
/// when it names one, every target when it names none. The answer lists
/// what was probed, with the Session's next observation sequence taken
/// after every probe of it finished, so it is ordered after every earlier
/// stall terminal (R-SEQ-1).
pub fn capabilities_probe(
    filter: Option<&ProbeTarget>,
    adapter: AdapterKind,
    target: &str,
) -> bool {
    filter.is_none_or(|t| t.adapter == adapter && t.target == target)
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
    fn only_an_answer_from_the_target_is_a_verdict_r_wd_5() {
        let classify = ProbeEvidence::classify;
        assert_eq!(classify(ProbeAnswer::Models), available());
        assert_eq!(
            classify(ProbeAnswer::HttpStatus(503)),
            unavailable(HealthFailureCode::Http5xx)
        );
        assert_eq!(
            classify(ProbeAnswer::HttpStatus(401)),
            unavailable(HealthFailureCode::AuthenticationFailed)
        );
        assert_eq!(
            classify(ProbeAnswer::HttpStatus(302)),
            unavailable(HealthFailureCode::ProviderRejected)
        );
        assert_eq!(
            classify(ProbeAnswer::Unhealthy(HealthFailureCode::Http5xx)),
            unavailable(HealthFailureCode::Http5xx)
        );
        let unknown = |code| ProbeEvidence::new(ProviderHealth::Unknown, Some(code));
        assert_eq!(
            classify(ProbeAnswer::TimedOut),
            unknown(HealthFailureCode::Timeout)
        );
        assert_eq!(
            classify(ProbeAnswer::TransportFailed),
            unknown(HealthFailureCode::TransportFailed)
        );
        assert_eq!(
            classify(ProbeAnswer::Malformed),
            unknown(HealthFailureCode::MalformedResponse)
        );
        // A success status that carried no model list is no verdict either.
        assert_eq!(
            classify(ProbeAnswer::HttpStatus(204)),
            unknown(HealthFailureCode::MalformedResponse)
        );
    }

    #[test]
    fn probe_error_or_timeout_reads_as_health_unknown_to_the_watchdog() {
        for answer in [
            ProbeAnswer::TimedOut,
            ProbeAnswer::TransportFailed,
            ProbeAnswer::Malformed,
        ] {
            let evidence = ProbeEvidence::classify(answer);
            assert_eq!(evidence.outcome(), ProbeOutcome::Failed, "{answer:?}");
            assert_eq!(
                evidence.health.liveness_classification(),
                iop_wire::LivenessClassification::HealthUnknown
            );
            // Whatever the credential source: no verdict stays no verdict.
            for credential in [MANAGED, STANDING] {
                assert_eq!(evidence.for_target(credential), evidence, "{answer:?}");
            }
        }
        assert_eq!(
            ProbeEvidence::classify(ProbeAnswer::HttpStatus(500)).outcome(),
            ProbeOutcome::Unhealthy(Some(HealthFailureCode::Http5xx))
        );
        assert_eq!(
            ProbeEvidence::classify(ProbeAnswer::Models).outcome(),
            ProbeOutcome::Healthy
        );
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

    #[test]
    fn a_capabilities_command_probes_exactly_the_target_it_names_r_cap_1() {
        let named = ProbeTarget {
            adapter: AdapterKind::OpenAi,
            target: "gpu-a".into(),
        };
        assert!(capabilities_probe(None, AdapterKind::Ollama, "x"));
        assert!(capabilities_probe(
            Some(&named),
            AdapterKind::OpenAi,
            "gpu-a"
        ));
        assert!(!capabilities_probe(
            Some(&named),
            AdapterKind::Ollama,
            "gpu-a"
        ));
        assert!(!capabilities_probe(
            Some(&named),
            AdapterKind::OpenAi,
            "gpu-b"
        ));
    }
}
