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

/// The start of the UTC day `YYYY-MM-DD`, Unix ms; `None` for anything
/// else (or a day before 1970).
pub fn parse_day(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let s = text.get(r)?;
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())?
    };
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days_in_month = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1..=12).contains(&m) || d < 1 || d > days_in_month[(m - 1) as usize] {
        return None;
    }
    // Days from the civil date (H. Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days).ok().map(|days| days * DAY_MS)
}

/// The UTC day holding `unix_ms` as `YYYY-MM-DD`.
pub fn format_day(unix_ms: u64) -> String {
    let z = (unix_ms / DAY_MS) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
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
                cache_write_input: 0,
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
    fn days_read_and_print_as_utc_dates() {
        assert_eq!(parse_day("1970-01-01"), Some(0));
        assert_eq!(parse_day("2026-12-05"), Some(20_792 * DAY_MS));
        assert_eq!(format_day(20_792 * DAY_MS + 5), "2026-12-05");
        assert_eq!(
            parse_day("2024-02-29").map(format_day).as_deref(),
            Some("2024-02-29")
        );
        for bad in [
            "2023-02-29",
            "2026-13-01",
            "2026-1-01",
            "20261205",
            "1969-12-31",
            "2026-12-0x",
            "",
        ] {
            assert_eq!(parse_day(bad), None, "{bad:?}");
        }
        for day in (0..40_000u64).step_by(37) {
            assert_eq!(parse_day(&format_day(day * DAY_MS)), Some(day * DAY_MS));
        }
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
