//! What each key and each principal holds in the journal (R-TEN-1's
//! journal-bytes and background-response quotas), kept by every store
//! beside its records so that [`JournalStore::held`](crate::JournalStore::held)
//! answers at once: each record change moves the gauges of its key and its
//! principal by what it holds ([`RecordMeta::held`]) before and after.

use std::collections::HashMap;

use iop_core::journal::{NO_KEY_ID, RecordMeta};
use iop_core::tenant::{Held, Subject};

/// Journal gauges per key and per principal. A subject that holds nothing
/// is not kept, so the map holds at most two entries per record.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HeldGauges {
    by_key: HashMap<String, Held>,
    by_principal: HashMap<String, Held>,
}

/// What one record holds and against whom: what a store remembers of a
/// record to move the gauges later (e.g. once its batch is durable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    /// The principal that asked.
    pub principal: String,
    /// The key that asked ([`NO_KEY_ID`]: none known).
    pub key_id: String,
    /// What the record holds.
    pub held: Held,
}

impl Holding {
    /// What `meta` holds.
    pub fn of(meta: &RecordMeta) -> Self {
        Holding {
            principal: meta.principal.clone(),
            key_id: meta.key_id.clone(),
            held: meta.held(),
        }
    }
}

fn add(map: &mut HashMap<String, Held>, name: &str, held: Held) {
    if held == Held::default() {
        return;
    }
    let gauge = match map.get_mut(name) {
        Some(gauge) => gauge,
        None => map.entry(name.to_owned()).or_default(),
    };
    gauge.journal_bytes = gauge.journal_bytes.saturating_add(held.journal_bytes);
    gauge.background = gauge.background.saturating_add(held.background);
}

fn sub(map: &mut HashMap<String, Held>, name: &str, held: Held) {
    if let Some(gauge) = map.get_mut(name) {
        gauge.journal_bytes = gauge.journal_bytes.saturating_sub(held.journal_bytes);
        gauge.background = gauge.background.saturating_sub(held.background);
        if *gauge == Held::default() {
            map.remove(name);
        }
    }
}

impl HeldGauges {
    /// No record counted.
    pub fn new() -> Self {
        Self::default()
    }

    /// What `subject` holds now.
    pub fn held(&self, subject: &Subject) -> Held {
        let (map, name) = match subject {
            Subject::Key(id) => (&self.by_key, id),
            Subject::Principal(name) => (&self.by_principal, name),
            // The journal's quotas are a key's and a principal's alone.
            Subject::KeyModel { .. } | Subject::PrincipalModel { .. } => return Held::default(),
        };
        map.get(name.as_str()).copied().unwrap_or_default()
    }

    /// A record that held `old` now holds `new` (`None`: absent before, or
    /// gone now).
    pub fn change(&mut self, old: Option<&Holding>, new: Option<&Holding>) {
        if let Some(h) = old {
            self.count(&h.principal, &h.key_id, h.held, sub);
        }
        if let Some(h) = new {
            self.count(&h.principal, &h.key_id, h.held, add);
        }
    }

    /// As [`Self::change`], from the records themselves.
    pub fn change_meta(&mut self, old: Option<&RecordMeta>, new: Option<&RecordMeta>) {
        if let Some(m) = old {
            self.count(&m.principal, &m.key_id, m.held(), sub);
        }
        if let Some(m) = new {
            self.count(&m.principal, &m.key_id, m.held(), add);
        }
    }

    /// As [`Self::change`], from what the records hold, each as
    /// (principal, key id, held).
    pub fn change_parts(
        &mut self,
        old: Option<(&str, &str, Held)>,
        new: Option<(&str, &str, Held)>,
    ) {
        if let Some((principal, key_id, held)) = old {
            self.count(principal, key_id, held, sub);
        }
        if let Some((principal, key_id, held)) = new {
            self.count(principal, key_id, held, add);
        }
    }

    fn count(
        &mut self,
        principal: &str,
        key_id: &str,
        held: Held,
        op: fn(&mut HashMap<String, Held>, &str, Held),
    ) {
        op(&mut self.by_principal, principal, held);
        if key_id != NO_KEY_ID {
            op(&mut self.by_key, key_id, held);
        }
    }

    /// Subjects counted (keys and principals that hold something).
    pub fn len(&self) -> usize {
        self.by_key.len() + self.by_principal.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use iop_core::journal::{JournalApi, RecordStatus, Terminal};

    use super::*;

    fn meta(key_id: &str, bytes: u64, background: bool, ended: bool) -> RecordMeta {
        RecordMeta {
            id: "r".into(),
            principal: "p".into(),
            api: JournalApi::Responses,
            model: "m".into(),
            fingerprint: [0; 32],
            idempotency_key: None,
            background,
            created_unix_ms: 0,
            epoch: 1,
            last_seq: 0,
            terminal: ended.then_some(Terminal {
                status: RecordStatus::Completed,
                reason: None,
                message: None,
                at_unix_ms: 1,
            }),
            expires_unix_ms: u64::MAX,
            stored_bytes: bytes,
            owner: "edge".into(),
            key_id: key_id.into(),
        }
    }

    fn held(g: &HeldGauges, s: Subject) -> (u64, u64) {
        let h = g.held(&s);
        (h.journal_bytes, h.background)
    }

    #[test]
    fn r_ten_1_gauges_follow_a_record_per_key_and_principal_and_forget_what_holds_nothing() {
        let mut g = HeldGauges::new();
        let a = meta("k1", 300, true, false);
        g.change_meta(None, Some(&a));
        let b = meta("k2", 200, false, false);
        g.change(None, Some(&Holding::of(&b)));
        assert_eq!(held(&g, Subject::Key("k1".into())), (300, 1));
        assert_eq!(held(&g, Subject::Key("k2".into())), (200, 0));
        assert_eq!(held(&g, Subject::Principal("p".into())), (500, 1));
        let a2 = meta("k1", 350, true, true);
        g.change_meta(Some(&a), Some(&a2));
        assert_eq!(held(&g, Subject::Key("k1".into())), (350, 0));
        g.change_meta(Some(&a2), None);
        g.change(Some(&Holding::of(&b)), None);
        assert_eq!(held(&g, Subject::Principal("p".into())), (0, 0));
        assert!(g.is_empty(), "{g:?}");
    }

    #[test]
    fn a_record_of_no_key_counts_for_its_principal_only() {
        let mut g = HeldGauges::new();
        g.change_meta(None, Some(&meta(NO_KEY_ID, 100, true, false)));
        assert_eq!(held(&g, Subject::Principal("p".into())), (100, 1));
        assert_eq!(held(&g, Subject::Key(NO_KEY_ID.into())), (0, 0));
        assert_eq!(g.len(), 1);
    }
}
