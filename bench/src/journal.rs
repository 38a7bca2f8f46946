//! The Edge's journal metrics, read from its `/metrics` (Prometheus text)
//! around a run: how many store operations each durable response cost, and
//! how long each took until it was durable.
//!
//! Two series are read (docs/durability.md, "Observing it"):
//!
//! * `iop_edge_journal_writes_total{op, outcome}`: operations by kind
//!   (`create`, `append`, `finish`, `raise_epoch`) and outcome (`ok` or a
//!   refusal);
//! * `iop_edge_journal_write_seconds{op}`: a histogram of the time from the
//!   call until the store answered (for `append`, until the events were
//!   durable, R-JRN-1): its `_count`, `_sum` and `_bucket` lines.
//!
//! A [`JournalSnapshot`] is one scrape; [`JournalSnapshot::since`] is what
//! happened between two.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Bound of one scrape.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// Series kept per scrape at most (the Edge exports a few hundred).
const MAX_SERIES: usize = 10_000;

const WRITES: &str = "iop_edge_journal_writes_total";
const SECONDS: &str = "iop_edge_journal_write_seconds";
const RECORDS: &str = "iop_edge_journal_records";
const BYTES: &str = "iop_edge_journal_bytes";

/// Why the metrics could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The request failed.
    #[error("GET /metrics: {0}")]
    Http(#[from] reqwest::Error),
    /// The Edge answered with an error status.
    #[error("GET /metrics answered {0}")]
    Status(u16),
}

/// One operation kind's counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OpCounters {
    /// Answered `ok`.
    pub ok: u64,
    /// Refused or failed, any other outcome.
    pub failed: u64,
    /// Samples of the time histogram.
    pub count: u64,
    /// Sum of the time histogram, seconds.
    pub sum_s: f64,
    /// Cumulative buckets: `(upper bound in seconds, samples at or
    /// below)`, ascending, `+Inf` left out.
    pub buckets: Vec<(f64, u64)>,
}

/// The journal counters of one scrape, by `op`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JournalSnapshot {
    ops: BTreeMap<String, OpCounters>,
    /// `iop_edge_journal_records`: the records the store holds.
    records: Option<u64>,
    /// `iop_edge_journal_bytes`: the bytes they hold.
    bytes: Option<u64>,
}

/// What one operation kind did between two scrapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpStats {
    /// `create`, `append`, `finish`, `raise_epoch`.
    pub op: String,
    /// Answered `ok`.
    pub ok: u64,
    /// Refused or failed.
    pub failed: u64,
    /// Timed operations.
    pub count: u64,
    /// Their total time, seconds.
    pub sum_s: f64,
    /// The upper bound of the bucket holding the median, seconds (`None`
    /// with no samples, or past the last bound).
    pub p50_at_most_s: Option<f64>,
    /// The same for the 99th percentile.
    pub p99_at_most_s: Option<f64>,
}

impl OpStats {
    /// Mean time until durable, seconds.
    pub fn mean_s(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_s / self.count as f64)
    }
}

/// Read the Edge's journal counters now.
pub async fn scrape(
    client: &reqwest::Client,
    edge_http: SocketAddr,
) -> Result<JournalSnapshot, ScrapeError> {
    let r = client
        .get(format!("http://{edge_http}/metrics"))
        .timeout(SCRAPE_TIMEOUT)
        .send()
        .await?;
    if !r.status().is_success() {
        return Err(ScrapeError::Status(r.status().as_u16()));
    }
    Ok(JournalSnapshot::parse(&r.text().await?))
}

/// One sample line of the text format.
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, &'a str)>,
    value: f64,
}

/// Read one sample line; `None` for comments, blank lines and what does
/// not parse.
fn sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    // The label values of these series are closed vocabularies (no
    // commas, quotes or escapes).
    let labels = labels
        .split(',')
        .filter(|l| !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            Some((k.trim(), v.trim().strip_prefix('"')?.strip_suffix('"')?))
        })
        .collect();
    Some(Sample {
        name,
        labels,
        value,
    })
}

fn label<'a>(labels: &[(&str, &'a str)], key: &str) -> Option<&'a str> {
    labels.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
}

/// A counter's value as an integer (Prometheus writes floats).
fn whole(v: f64) -> u64 {
    if v.is_finite() && v > 0.0 {
        v.round() as u64
    } else {
        0
    }
}

impl JournalSnapshot {
    /// Parse the journal series out of a Prometheus text page; every other
    /// line is ignored.
    pub fn parse(text: &str) -> Self {
        let mut ops: BTreeMap<String, OpCounters> = BTreeMap::new();
        let (mut records, mut bytes) = (None, None);
        for line in text.lines().take(MAX_SERIES) {
            let Some(Sample {
                name,
                labels,
                value,
            }) = sample(line)
            else {
                continue;
            };
            match name {
                RECORDS => records = Some(whole(value)),
                BYTES => bytes = Some(whole(value)),
                _ => {}
            }
            let Some(op) = label(&labels, "op") else {
                continue;
            };
            if name != WRITES && !name.starts_with(SECONDS) {
                continue;
            }
            let entry = ops.entry(op.to_owned()).or_default();
            match name.strip_prefix(SECONDS) {
                Some("_count") => entry.count = whole(value),
                Some("_sum") => entry.sum_s = value,
                Some("_bucket") => {
                    if let Some(le) = label(&labels, "le").and_then(|le| le.parse::<f64>().ok())
                        && le.is_finite()
                    {
                        entry.buckets.push((le, whole(value)));
                    }
                }
                _ => match label(&labels, "outcome") {
                    Some("ok") => entry.ok += whole(value),
                    Some(_) => entry.failed += whole(value),
                    None => {}
                },
            }
        }
        for counters in ops.values_mut() {
            counters
                .buckets
                .sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        }
        JournalSnapshot {
            ops,
            records,
            bytes,
        }
    }

    /// The records the journal holds (`iop_edge_journal_records`), if the
    /// page had the gauge.
    pub fn records(&self) -> Option<u64> {
        self.records
    }

    /// The bytes they hold (`iop_edge_journal_bytes`).
    pub fn bytes(&self) -> Option<u64> {
        self.bytes
    }

    /// The counters of `op`, if the page had them.
    pub fn op(&self, op: &str) -> Option<&OpCounters> {
        self.ops.get(op)
    }

    /// What each operation kind did since `before` (kinds with nothing
    /// done left out).
    pub fn since(&self, before: &JournalSnapshot) -> Vec<OpStats> {
        let zero = OpCounters::default();
        let mut out = Vec::new();
        for (op, now) in &self.ops {
            let was = before.ops.get(op).unwrap_or(&zero);
            let count = now.count.saturating_sub(was.count);
            let ok = now.ok.saturating_sub(was.ok);
            let failed = now.failed.saturating_sub(was.failed);
            if count == 0 && ok == 0 && failed == 0 {
                continue;
            }
            let buckets: Vec<(f64, u64)> = now
                .buckets
                .iter()
                .map(|&(le, n)| {
                    let old = was
                        .buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0, |(_, n)| *n);
                    (le, n.saturating_sub(old))
                })
                .collect();
            let at_most = |q: f64| {
                let rank = (q * count as f64).ceil().max(1.0) as u64;
                buckets.iter().find(|(_, n)| *n >= rank).map(|(le, _)| *le)
            };
            out.push(OpStats {
                op: op.clone(),
                ok,
                failed,
                count,
                sum_s: (now.sum_s - was.sum_s).max(0.0),
                p50_at_most_s: (count > 0).then(|| at_most(0.50)).flatten(),
                p99_at_most_s: (count > 0).then(|| at_most(0.99)).flatten(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP iop_edge_journal_writes_total Journal store operations
# TYPE iop_edge_journal_writes_total counter
iop_edge_journal_writes_total{op="append",outcome="ok"} 30
iop_edge_journal_writes_total{op="append",outcome="fenced"} 1
iop_edge_journal_writes_total{op="create",outcome="ok"} 10
iop_edge_journal_write_seconds_bucket{op="append",le="0.001"} 10
iop_edge_journal_write_seconds_bucket{op="append",le="0.005"} 29
iop_edge_journal_write_seconds_bucket{op="append",le="0.01"} 31
iop_edge_journal_write_seconds_bucket{op="append",le="+Inf"} 31
iop_edge_journal_write_seconds_sum{op="append"} 0.093
iop_edge_journal_write_seconds_count{op="append"} 31
iop_edge_requests_total{route="chat",outcome="ok"} 10
"#;

    #[test]
    fn the_journal_series_are_read_and_everything_else_ignored() {
        let s = JournalSnapshot::parse(PAGE);
        let append = s.op("append").unwrap();
        assert_eq!((append.ok, append.failed, append.count), (30, 1, 31));
        assert!((append.sum_s - 0.093).abs() < 1e-12);
        assert_eq!(append.buckets, vec![(0.001, 10), (0.005, 29), (0.01, 31)]);
        assert_eq!(s.op("create").unwrap().ok, 10);
        assert!(s.op("chat").is_none());
    }

    #[test]
    fn since_is_the_difference_with_bucket_bounds_of_the_quantiles() {
        let before = JournalSnapshot::parse(
            "iop_edge_journal_writes_total{op=\"append\",outcome=\"ok\"} 10\n\
             iop_edge_journal_write_seconds_bucket{op=\"append\",le=\"0.001\"} 10\n\
             iop_edge_journal_write_seconds_bucket{op=\"append\",le=\"0.005\"} 10\n\
             iop_edge_journal_write_seconds_bucket{op=\"append\",le=\"0.01\"} 10\n\
             iop_edge_journal_write_seconds_sum{op=\"append\"} 0.003\n\
             iop_edge_journal_write_seconds_count{op=\"append\"} 10\n",
        );
        let after = JournalSnapshot::parse(PAGE);
        let d = after.since(&before);
        let append = d.iter().find(|o| o.op == "append").unwrap();
        assert_eq!((append.ok, append.failed, append.count), (20, 1, 21));
        assert!((append.mean_s().unwrap() - 0.090 / 21.0).abs() < 1e-9);
        // 19 of the 21 new samples are in (0.001, 0.005], 2 above.
        assert_eq!(append.p50_at_most_s, Some(0.005));
        assert_eq!(append.p99_at_most_s, Some(0.01));
        let create = d.iter().find(|o| o.op == "create").unwrap();
        assert_eq!((create.ok, create.count, create.mean_s()), (10, 0, None));
        assert!(after.since(&after).is_empty(), "nothing happened");
    }
}
