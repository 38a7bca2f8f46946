//! Usage and spend (SPEC §9, R-TEN-5): what each request used, summed per
//! UTC day, principal, key and model in the deployment's store, so an
//! operator reads the same totals from every Edge.
//!
//! An Edge adds a request's use when it is settled ([`UsageBook`] sums
//! them in memory and hands the sums to the store in batches, so the hot
//! path never waits on a store write); the store adds each batch to its
//! rows.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{DAY_MS, TokenUse};

/// One row of usage: a UTC day, a principal, a key and a model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct UsageKey {
    /// The day's start, Unix ms.
    pub day_unix_ms: u64,
    /// The principal.
    pub principal: String,
    /// The key's id.
    pub key: String,
    /// The model as the client named it.
    pub model: String,
}

/// What a row counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageTotals {
    /// Requests settled (admitted and ended).
    pub requests: u64,
    /// Input tokens, cached ones included.
    pub input_tokens: u64,
    /// Of them, served from the provider's cache.
    pub cached_input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Spend, micro-units.
    pub spend_micros: u64,
}

impl UsageTotals {
    /// The totals of one request that used `used` and cost `spend_micros`.
    pub fn of(used: TokenUse, spend_micros: u64) -> Self {
        UsageTotals {
            requests: 1,
            input_tokens: used.input,
            cached_input_tokens: used.cached_input.min(used.input),
            output_tokens: used.output,
            spend_micros,
        }
    }

    /// Add `other` (saturating).
    pub fn add(&mut self, other: &UsageTotals) {
        self.requests = self.requests.saturating_add(other.requests);
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.cached_input_tokens = self
            .cached_input_tokens
            .saturating_add(other.cached_input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.spend_micros = self.spend_micros.saturating_add(other.spend_micros);
    }
}

/// The start of the UTC day holding `unix_ms`.
pub fn day_of(unix_ms: u64) -> u64 {
    unix_ms - unix_ms % DAY_MS
}

/// Which rows a usage read wants: days `from..=to` (their starts), and
/// optionally one principal or key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageQuery {
    /// The first day's start, Unix ms.
    pub from_day_unix_ms: u64,
    /// The last day's start, Unix ms (inclusive).
    pub to_day_unix_ms: u64,
    /// Only this principal's rows.
    pub principal: Option<String>,
    /// Only this key's rows.
    pub key: Option<String>,
    /// At most this many rows.
    pub max_rows: usize,
}

impl UsageQuery {
    /// Whether `key` is one of the rows asked for.
    pub fn matches(&self, key: &UsageKey) -> bool {
        key.day_unix_ms >= self.from_day_unix_ms
            && key.day_unix_ms <= self.to_day_unix_ms
            && self.principal.as_ref().is_none_or(|p| *p == key.principal)
            && self.key.as_ref().is_none_or(|k| *k == key.key)
    }
}

/// The most rows a [`UsageBook`] holds before it must be flushed; past
/// it, a row is folded into its day's `other` model so memory stays
/// bounded whatever model names clients send.
pub const MAX_BOOK_ROWS: usize = 4_096;

/// The model name rows are folded into when a book is full.
pub const OTHER_MODEL: &str = "(other)";

/// Usage settled on one Edge and not yet written to the store.
#[derive(Debug, Default)]
pub struct UsageBook {
    rows: BTreeMap<UsageKey, UsageTotals>,
}

impl UsageBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one request's use.
    pub fn add(&mut self, mut key: UsageKey, totals: UsageTotals) {
        if self.rows.len() >= MAX_BOOK_ROWS && !self.rows.contains_key(&key) {
            key.model = OTHER_MODEL.to_owned();
        }
        self.rows.entry(key).or_default().add(&totals);
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Take every row for the store.
    pub fn take(&mut self) -> Vec<(UsageKey, UsageTotals)> {
        std::mem::take(&mut self.rows).into_iter().collect()
    }

    /// Put back rows the store did not take (a failed write): they are
    /// added to what was settled since.
    pub fn put_back(&mut self, rows: Vec<(UsageKey, UsageTotals)>) {
        for (key, totals) in rows {
            self.add(key, totals);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(model: &str) -> UsageKey {
        UsageKey {
            day_unix_ms: day_of(3 * DAY_MS + 5),
            principal: "p".into(),
            key: "k".into(),
            model: model.into(),
        }
    }

    #[test]
    fn r_ten_5_a_book_sums_rows_and_keeps_what_a_failed_write_put_back() {
        let mut book = UsageBook::new();
        let one = UsageTotals::of(
            TokenUse {
                input: 10,
                cached_input: 4,
                output: 5,
            },
            7,
        );
        book.add(key("m"), one);
        book.add(key("m"), one);
        let rows = book.take();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].0.day_unix_ms, 3 * DAY_MS);
        assert_eq!(rows[0].1.requests, 2);
        assert_eq!(rows[0].1.spend_micros, 14);
        assert!(book.is_empty());
        book.add(key("m"), one);
        book.put_back(rows);
        assert_eq!(book.take()[0].1.requests, 3);
    }

    #[test]
    fn r_lim_1_a_full_book_folds_new_models_into_other() {
        let mut book = UsageBook::new();
        for i in 0..MAX_BOOK_ROWS + 100 {
            book.add(
                key(&format!("m{i}")),
                UsageTotals::of(TokenUse::default(), 0),
            );
        }
        let rows = book.take();
        assert_eq!(rows.len(), MAX_BOOK_ROWS + 1);
        let other = rows.iter().find(|(k, _)| k.model == OTHER_MODEL).unwrap();
        assert_eq!(other.1.requests, 100);
    }
}
