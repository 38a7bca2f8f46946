//! Reports: what one load run measured (JSON), and markdown tables.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Percentiles of one distribution, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Samples recorded.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Largest sample.
    pub max_us: u64,
    /// Mean.
    pub mean_us: f64,
}

impl Percentiles {
    /// Summarise a histogram of microseconds; `None` when it is empty.
    pub fn of(h: &Histogram<u64>) -> Option<Self> {
        (!h.is_empty()).then(|| Self {
            count: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
            mean_us: h.mean(),
        })
    }

    /// The four reported percentiles, in order p50, p90, p99, p99.9.
    pub fn quantiles_us(&self) -> [u64; 4] {
        [self.p50_us, self.p90_us, self.p99_us, self.p999_us]
    }
}

/// How load was offered.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LoadMode {
    /// A fixed request rate; latency from each intended send time.
    Open {
        /// Requests per second offered.
        rate_per_s: f64,
    },
    /// A fixed number of clients, each sending its next request when the
    /// previous one ends; latency from the actual send time.
    Closed {
        /// Concurrent clients.
        concurrency: u32,
    },
}

impl LoadMode {
    /// `open 1000/s` or `closed x32`.
    pub fn label(&self) -> String {
        match self {
            LoadMode::Open { rate_per_s } => format!("open {rate_per_s:.0}/s"),
            LoadMode::Closed { concurrency } => format!("closed x{concurrency}"),
        }
    }
}

/// What one load run measured. Only requests whose (intended) send time
/// fell inside the measured window, after the warm-up, are counted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// What was measured (`direct`, `tunnel`, `normalized`, ...).
    pub label: String,
    /// How load was offered.
    pub mode: LoadMode,
    /// Streamed (SSE) or not.
    pub stream: bool,
    /// Length of the measured window, in seconds.
    pub window_s: f64,
    /// Requests sent (or due, in open loop) in the window.
    pub requests: u64,
    /// Requests that completed correctly.
    pub ok: u64,
    /// Failed requests by kind (`http_503`, `transport`, `timeout`, ...).
    pub errors: BTreeMap<String, u64>,
    /// `ok / window_s`.
    pub throughput_rps: f64,
    /// SSE data events received (streams only).
    pub chunks: u64,
    /// `chunks / window_s`.
    pub chunks_per_s: f64,
    /// Total latency of successful requests.
    pub total: Option<Percentiles>,
    /// Time to the first content chunk (streams only).
    pub ttft: Option<Percentiles>,
    /// Time between consecutive chunks of one stream (streams only).
    pub gap: Option<Percentiles>,
}

impl LoadReport {
    /// All failed requests.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// Microseconds as milliseconds with three decimals.
pub fn ms(us: u64) -> String {
    format!("{:.3}", us as f64 / 1000.0)
}

/// A signed microsecond difference as milliseconds with three decimals.
pub fn ms_signed(us: i64) -> String {
    format!("{:+.3}", us as f64 / 1000.0)
}

fn errors_cell(r: &LoadReport) -> String {
    if r.errors.is_empty() {
        return "0".to_owned();
    }
    r.errors
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn pct_cell(p: Option<&Percentiles>, pick: impl Fn(&Percentiles) -> u64) -> String {
    p.map_or_else(|| "-".to_owned(), |p| ms(pick(p)))
}

/// One markdown table of load runs (latencies in ms).
pub fn load_table(reports: &[LoadReport]) -> String {
    let mut out = String::from(
        "| target | load | stream | ok | errors | rps | p50 | p90 | p99 | p99.9 | TTFT p50 | TTFT p99 | gap p50 | gap p99 | chunks/s |\n\
         | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in reports {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} |\n",
            r.label,
            r.mode.label(),
            if r.stream { "yes" } else { "no" },
            r.ok,
            errors_cell(r),
            r.throughput_rps,
            pct_cell(r.total.as_ref(), |p| p.p50_us),
            pct_cell(r.total.as_ref(), |p| p.p90_us),
            pct_cell(r.total.as_ref(), |p| p.p99_us),
            pct_cell(r.total.as_ref(), |p| p.p999_us),
            pct_cell(r.ttft.as_ref(), |p| p.p50_us),
            pct_cell(r.ttft.as_ref(), |p| p.p99_us),
            pct_cell(r.gap.as_ref(), |p| p.p50_us),
            pct_cell(r.gap.as_ref(), |p| p.p99_us),
            r.chunks_per_s,
        ));
    }
    out
}

/// Added latency of `via` over `direct` at the same load: `via - direct`
/// for each of p50, p90, p99, p99.9, in microseconds.
pub fn added_us(direct: &LoadReport, via: &LoadReport) -> Option<[i64; 4]> {
    let d = direct.total?.quantiles_us();
    let v = via.total?.quantiles_us();
    Some(std::array::from_fn(|i| v[i] as i64 - d[i] as i64))
}

/// One row of an added-latency comparison: a baseline and the runs through
/// each gateway at the same load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// The baseline (direct to the upstream).
    pub direct: LoadReport,
    /// The same load through each gateway.
    pub via: Vec<LoadReport>,
}

/// The added-latency table: per load and gateway, the baseline's
/// percentiles, the gateway's, and the difference (ms).
pub fn added_latency_table(rows: &[Comparison]) -> String {
    let mut out = String::from(
        "| load | target | ok | errors | rps | p50 | p90 | p99 | p99.9 | added p50 | added p90 | added p99 | added p99.9 |\n\
         | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for row in rows {
        for r in std::iter::once(&row.direct).chain(&row.via) {
            let added = if std::ptr::eq(r, &row.direct) {
                None
            } else {
                added_us(&row.direct, r)
            };
            let a = |i: usize| added.map_or_else(|| "-".to_owned(), |a| ms_signed(a[i]));
            out.push_str(&format!(
                "| {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.mode.label(),
                r.label,
                r.ok,
                errors_cell(r),
                r.throughput_rps,
                pct_cell(r.total.as_ref(), |p| p.p50_us),
                pct_cell(r.total.as_ref(), |p| p.p90_us),
                pct_cell(r.total.as_ref(), |p| p.p99_us),
                pct_cell(r.total.as_ref(), |p| p.p999_us),
                a(0),
                a(1),
                a(2),
                a(3),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(label: &str, us: &[u64]) -> LoadReport {
        let mut h = Histogram::<u64>::new(3).unwrap();
        for v in us {
            h.record(*v).unwrap();
        }
        LoadReport {
            label: label.to_owned(),
            mode: LoadMode::Open { rate_per_s: 100.0 },
            stream: false,
            window_s: 1.0,
            requests: us.len() as u64,
            ok: us.len() as u64,
            errors: BTreeMap::new(),
            throughput_rps: us.len() as f64,
            chunks: 0,
            chunks_per_s: 0.0,
            total: Percentiles::of(&h),
            ttft: None,
            gap: None,
        }
    }

    #[test]
    fn added_latency_is_via_minus_direct_per_percentile() {
        let direct = report("direct", &[1000; 100]);
        let via = report("via", &[1500; 100]);
        assert_eq!(added_us(&direct, &via), Some([500; 4]));
        let table = added_latency_table(&[Comparison {
            direct,
            via: vec![via],
        }]);
        assert!(table.contains("| open 100/s | via | 100 | 0 | 100 | 1.500 |"));
        assert!(table.contains("+0.500"));
    }

    #[test]
    fn empty_histogram_has_no_percentiles() {
        assert_eq!(Percentiles::of(&Histogram::<u64>::new(3).unwrap()), None);
    }
}
