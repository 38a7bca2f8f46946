//! The runtime health overlay and CAPABILITIES recovery (R-OVL-1, R-OVL-2,
//! R-CAP-1).
//!
//! The overlay is separate from configured health: it only records that,
//! within one generation of a provider's node, fresh stall evidence said the
//! provider is `unavailable`. It is scoped to that generation: a new
//! connection starts with a clean overlay. Freshness is the Node's
//! connection-scoped observation sequence (R-SEQ-1): evidence is applied
//! only if its sequence is strictly newer than the last one applied for that
//! provider in this generation.

use std::collections::BTreeMap;

use iop_wire::ProviderHealth;

use crate::ids::{Generation, ProviderId};
#[cfg(feature = "planted-bugs")]
use crate::planted::{Planted, PlantedBug};

/// What happened to one piece of stall evidence (R-OVL-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvidenceOutcome {
    /// Fresh `unavailable`: the provider is now lowered.
    Lowered,
    /// Fresh, but not `unavailable`: recorded, nothing lowered.
    Recorded,
    /// Not strictly newer than the last applied evidence (or no sequence):
    /// ignored.
    Stale,
}

impl EvidenceOutcome {
    /// Closed label value.
    pub fn as_str(self) -> &'static str {
        match self {
            EvidenceOutcome::Lowered => "lowered",
            EvidenceOutcome::Recorded => "recorded",
            EvidenceOutcome::Stale => "stale",
        }
    }
}

/// What a CAPABILITIES answer did for one provider (R-CAP-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryOutcome {
    /// A strictly newer `available` raised the lowered provider.
    Recovered,
    /// The provider was not lowered in this generation: nothing to do.
    NotLowered,
    /// The answer was not strictly newer: nothing changed.
    Stale,
    /// The answer was `unavailable` or `unknown`: nothing changed.
    NotAvailable,
}

impl RecoveryOutcome {
    /// Closed label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryOutcome::Recovered => "recovered",
            RecoveryOutcome::NotLowered => "not_lowered",
            RecoveryOutcome::Stale => "stale",
            RecoveryOutcome::NotAvailable => "not_available",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    generation: Generation,
    last_seq: Option<u64>,
    lowered: bool,
}

/// Per-provider runtime overlay.
#[derive(Debug, Default)]
pub struct Overlay {
    entries: BTreeMap<ProviderId, Entry>,
    #[cfg(feature = "planted-bugs")]
    planted: Planted,
}

impl Overlay {
    /// An empty overlay.
    pub fn new() -> Self {
        Self::default()
    }

    /// Switch a planted bug on (test-only; see [`crate::planted`]).
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&self, bug: PlantedBug) {
        self.planted.plant(bug);
    }

    fn entry(&mut self, provider: &ProviderId, generation: Generation) -> &mut Entry {
        let entry = self.entries.entry(provider.clone()).or_insert(Entry {
            generation,
            last_seq: None,
            lowered: false,
        });
        if entry.generation != generation {
            // Scoped to the generation that produced it (R-OVL-2).
            *entry = Entry {
                generation,
                last_seq: None,
                lowered: false,
            };
        }
        entry
    }

    /// Apply validated, current stall evidence for `provider` from
    /// `generation` (R-OVL-2). The caller has already checked that the
    /// terminal came from the current generation and matches its lease.
    pub fn apply_stall_evidence(
        &mut self,
        provider: &ProviderId,
        generation: Generation,
        seq: Option<u64>,
        health: ProviderHealth,
    ) -> EvidenceOutcome {
        #[cfg(feature = "planted-bugs")]
        let skip_freshness = self.planted.has(PlantedBug::LowerOnStaleEvidence);
        #[cfg(not(feature = "planted-bugs"))]
        let skip_freshness = false;
        let entry = self.entry(provider, generation);
        let Some(seq) = seq else {
            return EvidenceOutcome::Stale;
        };
        if !skip_freshness && entry.last_seq.is_some_and(|last| seq <= last) {
            return EvidenceOutcome::Stale;
        }
        entry.last_seq = Some(seq);
        if health == ProviderHealth::Unavailable {
            entry.lowered = true;
            EvidenceOutcome::Lowered
        } else {
            EvidenceOutcome::Recorded
        }
    }

    /// Apply one exact-target CAPABILITIES verdict for the single provider
    /// it matched (R-CAP-1). Only a strictly newer `available` raises a
    /// provider lowered in this generation.
    pub fn apply_capability(
        &mut self,
        provider: &ProviderId,
        generation: Generation,
        seq: u64,
        health: ProviderHealth,
    ) -> RecoveryOutcome {
        let entry = self.entry(provider, generation);
        if entry.last_seq.is_some_and(|last| seq <= last) {
            return RecoveryOutcome::Stale;
        }
        if health != ProviderHealth::Available {
            return RecoveryOutcome::NotAvailable;
        }
        // A newer `available` is applied even when there is nothing to
        // raise: evidence older than it must not lower the provider later
        // (R-OVL-2's freshness mark moves with it).
        entry.last_seq = Some(seq);
        if !entry.lowered {
            return RecoveryOutcome::NotLowered;
        }
        entry.lowered = false;
        RecoveryOutcome::Recovered
    }

    /// Is `provider` lowered in `generation`? Lowering in an older
    /// generation does not count.
    pub fn is_lowered(&self, provider: &ProviderId, generation: Generation) -> bool {
        self.entries
            .get(provider)
            .is_some_and(|e| e.generation == generation && e.lowered)
    }

    /// The last applied sequence for `provider` in `generation`.
    pub fn last_seq(&self, provider: &ProviderId, generation: Generation) -> Option<u64> {
        self.entries
            .get(provider)
            .filter(|e| e.generation == generation)
            .and_then(|e| e.last_seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> ProviderId {
        ProviderId::from("p")
    }

    /// R-OVL-2, R-CAP-1: a newer `available` answer that finds the
    /// provider not lowered still moves the freshness mark, so stall
    /// evidence older than it, arriving later, does not lower it.
    #[test]
    fn a_newer_available_answer_moves_the_freshness_mark_even_with_nothing_to_raise() {
        let mut o = Overlay::new();
        assert_eq!(
            o.apply_capability(&p(), 1, 5, ProviderHealth::Available),
            RecoveryOutcome::NotLowered
        );
        assert_eq!(o.last_seq(&p(), 1), Some(5));
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, Some(3), ProviderHealth::Unavailable),
            EvidenceOutcome::Stale
        );
        assert!(!o.is_lowered(&p(), 1), "older evidence does not lower it");
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, Some(6), ProviderHealth::Unavailable),
            EvidenceOutcome::Lowered
        );
    }

    #[test]
    fn only_fresh_unavailable_evidence_lowers() {
        let mut o = Overlay::new();
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, Some(1), ProviderHealth::Available),
            EvidenceOutcome::Recorded
        );
        assert!(!o.is_lowered(&p(), 1));
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, Some(2), ProviderHealth::Unknown),
            EvidenceOutcome::Recorded
        );
        assert!(!o.is_lowered(&p(), 1), "unknown never lowers");
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, Some(3), ProviderHealth::Unavailable),
            EvidenceOutcome::Lowered
        );
        assert!(o.is_lowered(&p(), 1));
    }

    #[test]
    fn stale_unavailable_evidence_does_not_lower() {
        let mut o = Overlay::new();
        o.apply_stall_evidence(&p(), 1, Some(5), ProviderHealth::Available);
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, Some(5), ProviderHealth::Unavailable),
            EvidenceOutcome::Stale
        );
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, Some(4), ProviderHealth::Unavailable),
            EvidenceOutcome::Stale
        );
        assert_eq!(
            o.apply_stall_evidence(&p(), 1, None, ProviderHealth::Unavailable),
            EvidenceOutcome::Stale,
            "evidence without a sequence cannot be fresh"
        );
        assert!(!o.is_lowered(&p(), 1));
    }

    #[test]
    fn overlay_is_scoped_to_the_generation_that_produced_it() {
        let mut o = Overlay::new();
        o.apply_stall_evidence(&p(), 1, Some(9), ProviderHealth::Unavailable);
        assert!(o.is_lowered(&p(), 1));
        assert!(!o.is_lowered(&p(), 2), "a new generation starts clean");
        // The new generation's sequence restarts at 1 and is fresh there.
        assert_eq!(
            o.apply_stall_evidence(&p(), 2, Some(1), ProviderHealth::Unavailable),
            EvidenceOutcome::Lowered
        );
    }

    #[test]
    fn last_seq_is_the_last_applied_in_that_generation_only() {
        let mut o = Overlay::new();
        assert_eq!(o.last_seq(&p(), 1), None, "nothing applied yet");
        o.apply_stall_evidence(&p(), 1, Some(7), ProviderHealth::Unavailable);
        assert_eq!(o.last_seq(&p(), 1), Some(7));
        assert_eq!(o.last_seq(&p(), 2), None, "another generation");
        assert_eq!(o.last_seq(&ProviderId::from("q"), 1), None);
        // Stale evidence leaves it; a recovery advances it.
        o.apply_stall_evidence(&p(), 1, Some(6), ProviderHealth::Unavailable);
        assert_eq!(o.last_seq(&p(), 1), Some(7));
        o.apply_capability(&p(), 1, 9, ProviderHealth::Available);
        assert_eq!(o.last_seq(&p(), 1), Some(9));
    }

    #[test]
    fn outcome_labels_are_closed_snake_case_values() {
        // R-OBS-1: these are metric label values; dashboards depend on them.
        let evidence = [
            EvidenceOutcome::Lowered,
            EvidenceOutcome::Recorded,
            EvidenceOutcome::Stale,
        ]
        .map(EvidenceOutcome::as_str);
        assert_eq!(evidence, ["lowered", "recorded", "stale"]);
        let recovery = [
            RecoveryOutcome::Recovered,
            RecoveryOutcome::NotLowered,
            RecoveryOutcome::Stale,
            RecoveryOutcome::NotAvailable,
        ]
        .map(RecoveryOutcome::as_str);
        assert_eq!(
            recovery,
            ["recovered", "not_lowered", "stale", "not_available"]
        );
    }

    #[test]
    fn capabilities_recover_only_from_strictly_newer_available() {
        let mut o = Overlay::new();
        o.apply_stall_evidence(&p(), 1, Some(3), ProviderHealth::Unavailable);
        assert_eq!(
            o.apply_capability(&p(), 1, 3, ProviderHealth::Available),
            RecoveryOutcome::Stale
        );
        assert_eq!(
            o.apply_capability(&p(), 1, 4, ProviderHealth::Unknown),
            RecoveryOutcome::NotAvailable
        );
        assert_eq!(
            o.apply_capability(&p(), 1, 4, ProviderHealth::Unavailable),
            RecoveryOutcome::NotAvailable
        );
        assert!(o.is_lowered(&p(), 1));
        assert_eq!(
            o.apply_capability(&p(), 1, 4, ProviderHealth::Available),
            RecoveryOutcome::Recovered
        );
        assert!(!o.is_lowered(&p(), 1));
        assert_eq!(
            o.apply_capability(&p(), 1, 5, ProviderHealth::Available),
            RecoveryOutcome::NotLowered
        );
    }
}
