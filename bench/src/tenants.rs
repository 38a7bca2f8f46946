//! The tenants scenario (issue 38, SPEC §9): what limits and budgets add
//! to a request, measured in one run on one Edge.
//!
//! The Edge serves the same provider under two models: the short mock's
//! own (`short`, asked with the bench key, whose principal has no limit,
//! no budget and no price: *off*) and [`metered_model`] (`short-metered`,
//! asked with [`METERED_KEY`], whose key has requests, tokens and
//! concurrency limits and whose principal has those and a budget, the
//! model priced: *on*). Every limit is far above what the run offers, so
//! nothing is refused; what is measured is the cost of counting, leasing
//! and settling. Rounds alternate which arm goes first, and each arm's
//! rounds are pooled into one latency histogram, so load from other jobs
//! on the machine falls on both arms alike.
//!
//! The tenants' counters live in the journal's store: the embedded store
//! for one Edge, or NATS JetStream key-value buckets (a real
//! `nats-server`), where every claim is a compare-and-set on the server.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::deployment::{API_KEY, Binaries, Deployment, DeploymentSpec, EdgeExtras, JournalStore};
use crate::gateway::{Gateway, SHORT_MOCK, ScenarioError, latency_deployment};
use crate::load::{self, LoadSpec, Target};
use crate::procfs::TICKS_PER_SECOND;
use crate::report::{LoadMode, LoadReport, Percentiles, ms, ms_signed};

/// The metered key's secret.
pub const METERED_KEY: &str = "sk-iop-bench-metered-0123456789abcdef";
/// The metered key's principal.
pub const METERED_PRINCIPAL: &str = "metered";
/// The metered key's file in the deployment's directory.
pub const METERED_KEY_FILE: &str = "api-key-metered";
/// The label of the arm without limits.
pub const OFF: &str = "limits off";
/// The label of the arm with limits and a budget.
pub const ON: &str = "limits on";

/// The metered model that routes to the same providers as `model`.
pub fn metered_model(model: &str) -> String {
    format!("{model}-metered")
}

/// The limits of the metered key and principal: each far above what the
/// scenario offers (1,000 requests/s is 60,000 a minute; each request
/// reserves its prompt and the default 4,096 output tokens at admission,
/// about 2,500 micro-units at the price below), so no request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeteredLimits {
    /// `requests_per_minute` of the key and of the principal.
    pub requests_per_minute: u64,
    /// `tokens_per_minute` of the key and of the principal.
    pub tokens_per_minute: u64,
    /// `concurrent_requests` of the key and of the principal.
    pub concurrent_requests: u64,
    /// The principal's `budget_micros` per day.
    pub budget_micros: u64,
    /// The metered model's input price per million tokens, micro-units.
    pub input_per_mtok: u64,
    /// Its output price per million tokens, micro-units.
    pub output_per_mtok: u64,
}

impl Default for MeteredLimits {
    fn default() -> Self {
        MeteredLimits {
            requests_per_minute: 6_000_000,
            tokens_per_minute: 100_000_000_000,
            concurrent_requests: 100_000,
            budget_micros: 10_000_000_000_000,
            input_per_mtok: 150_000,
            output_per_mtok: 600_000,
        }
    }
}

/// NATS JetStream reserves each bucket's and stream's `max_bytes` when it
/// makes them: the journal's bound and the tenants' buckets are kept small
/// (as the tests do), since this scenario journals nothing.
pub const NATS_JOURNAL_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// Each of the tenants' four NATS buckets, at most.
pub const NATS_TENANT_BUCKET_MAX_BYTES: u64 = 8 * 1024 * 1024;

/// The `[journal]` and `[journal.nats]` lines of a NATS store sized for a
/// scenario that journals little (no effect on the other stores).
pub fn small_nats_journal(extras: &mut EdgeExtras, store: JournalStore) {
    if store.needs_nats() {
        extras
            .journal
            .push_str(&format!("max_bytes = {NATS_JOURNAL_MAX_BYTES}\n"));
        extras.nats.push_str(&format!(
            "tenant_bucket_max_bytes = {NATS_TENANT_BUCKET_MAX_BYTES}\n"
        ));
    }
}

/// What the Edge config gains: the metered key (its secret in
/// [`METERED_KEY_FILE`]) with its limits, its principal's limits and
/// budget, a price for `metered`, and `metered` routed to `providers`.
pub fn metered_extras(
    metered: &str,
    providers: &[String],
    limits: &MeteredLimits,
    store: JournalStore,
) -> EdgeExtras {
    let MeteredLimits {
        requests_per_minute: rpm,
        tokens_per_minute: tpm,
        concurrent_requests: concurrent,
        budget_micros,
        input_per_mtok,
        output_per_mtok,
    } = *limits;
    let pool: Vec<String> = providers.iter().map(|p| format!("\"{p}\"")).collect();
    let tables = format!(
        r#"[[api_keys]]
principal = "{METERED_PRINCIPAL}"
key_file = "{METERED_KEY_FILE}"
limits = {{ requests_per_minute = {rpm}, tokens_per_minute = {tpm}, concurrent_requests = {concurrent} }}
[[principals]]
name = "{METERED_PRINCIPAL}"
limits = {{ requests_per_minute = {rpm}, tokens_per_minute = {tpm}, concurrent_requests = {concurrent}, budget_micros = {budget_micros}, budget_period = "day" }}
[[prices]]
model = "{metered}"
input_per_mtok = {input_per_mtok}
output_per_mtok = {output_per_mtok}
[[routes]]
model = "{metered}"
providers = [{}]
"#,
        pool.join(", ")
    );
    let mut extras = EdgeExtras {
        tables,
        key_files: vec![(METERED_KEY_FILE.to_owned(), METERED_KEY.to_owned())],
        ..EdgeExtras::default()
    };
    small_nats_journal(&mut extras, store);
    extras
}

/// The deployment of the tenants scenario: the latency scenario's shape
/// (the short mock behind one Node) with the metered key, principal,
/// price and route, the tenants' counters in `store`.
pub fn tenants_deployment(work: &std::path::Path, store: JournalStore) -> DeploymentSpec {
    let mut spec = latency_deployment(work, None);
    spec.dir = work.join(format!("tenants-{}", store.as_str()));
    spec.journal = store;
    // Only the short mock is asked.
    spec.mocks.retain(|m| m.name == SHORT_MOCK);
    let providers: Vec<String> = (1..=spec.nodes)
        .map(|i| format!("{SHORT_MOCK}-norm-n{i}"))
        .collect();
    spec.extras = metered_extras(
        &metered_model(SHORT_MOCK),
        &providers,
        &MeteredLimits::default(),
        store,
    );
    spec
}

/// The two arms (and the direct baseline) of one gateway.
#[derive(Debug, Clone)]
pub struct TenantArms {
    /// Straight to the mock (context: added latency), if it has an address.
    pub direct: Option<Target>,
    /// Through the Edge with the unlimited key.
    pub off: Target,
    /// Through the Edge with the metered key and model.
    pub on: Target,
}

impl TenantArms {
    /// The arms of `g` to the short mock: `off` is its normalized path with
    /// the bench key, `on` the same with the metered key and model.
    pub fn of(g: &dyn Gateway) -> Self {
        let off = g.via(SHORT_MOCK, false);
        let mut on = off.clone();
        on.api_key = Some(METERED_KEY.to_owned());
        on.model = metered_model(&off.model);
        TenantArms {
            direct: g.direct(SHORT_MOCK),
            off,
            on,
        }
    }
}

/// Settings of the tenants scenario.
#[derive(Debug, Clone)]
pub struct TenantSettings {
    /// Stores of the tenants' counters, one deployment each.
    pub stores: Vec<JournalStore>,
    /// Open-loop rate of every run.
    pub rate_per_s: f64,
    /// Length of each run, its warm-up included.
    pub round: Duration,
    /// Rounds; each runs both arms (and the direct baseline).
    pub rounds: usize,
    /// Runs of `round` each with the two arms' requests alternating one
    /// by one, `rate_per_s` in all (half each): both arms see the same
    /// moments of the machine.
    pub alternating_rounds: usize,
}

/// One arm over every round: its latency pooled, its errors, the Edge's
/// CPU per request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArmResult {
    /// `direct`, [`OFF`] or [`ON`].
    pub label: String,
    /// Percentiles of every round's measured window together.
    pub pooled: Option<Percentiles>,
    /// Successful requests in the measured windows.
    pub ok: u64,
    /// Failed ones, by kind (`http_429`, ...).
    pub errors: BTreeMap<String, u64>,
    /// The Edge's CPU time per request sent (whole runs, warm-up
    /// included), when the Edge is a process of its own.
    pub edge_us_per_request: Option<f64>,
    /// Each round's report.
    pub rounds: Vec<LoadReport>,
}

/// The tenants scenario on one store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantStoreResult {
    /// Where the tenants' counters were.
    pub store: JournalStore,
    /// The load of every run.
    pub mode: LoadMode,
    /// Seconds per run.
    pub round_s: f64,
    /// The direct baseline, when measured.
    pub direct: Option<ArmResult>,
    /// No limit.
    pub off: ArmResult,
    /// Limits and a budget.
    pub on: ArmResult,
    /// No limit, requests alternating with [`Self::alternating_on`]'s
    /// (half the rate each), when run.
    #[serde(default)]
    pub alternating_off: Option<ArmResult>,
    /// Limits and a budget, alternating with the off arm.
    #[serde(default)]
    pub alternating_on: Option<ArmResult>,
    /// `/status`'s `tenants` after the last round (claims, the store's
    /// reachability, today's usage per principal).
    pub status: serde_json::Value,
    /// `/proc/loadavg` before the first round and after the last.
    pub load_avg: [[f64; 3]; 2],
}

/// `on − off` per pooled percentile (p50, p90, p99, p99.9), µs.
fn pooled_diff(on: &ArmResult, off: &ArmResult) -> Option<[i64; 4]> {
    let (a, b) = (on.pooled?.quantiles_us(), off.pooled?.quantiles_us());
    Some(std::array::from_fn(|i| a[i] as i64 - b[i] as i64))
}

/// `on − off` per round, per percentile, µs.
fn round_diffs(on: &ArmResult, off: &ArmResult) -> Vec<[i64; 4]> {
    on.rounds
        .iter()
        .zip(&off.rounds)
        .filter_map(|(on, off)| {
            let (a, b) = (on.total?.quantiles_us(), off.total?.quantiles_us());
            Some(std::array::from_fn(|i| a[i] as i64 - b[i] as i64))
        })
        .collect()
}

/// The median of each percentile's differences.
fn median(rounds: &[[i64; 4]]) -> Option<[i64; 4]> {
    if rounds.is_empty() {
        return None;
    }
    Some(std::array::from_fn(|i| {
        let mut v: Vec<i64> = rounds.iter().map(|r| r[i]).collect();
        v.sort_unstable();
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2
        }
    }))
}

impl TenantStoreResult {
    /// On − off per pooled percentile (p50, p90, p99, p99.9), µs.
    pub fn added_us(&self) -> Option<[i64; 4]> {
        pooled_diff(&self.on, &self.off)
    }

    /// On − off per round, per percentile, µs.
    pub fn round_added_us(&self) -> Vec<[i64; 4]> {
        round_diffs(&self.on, &self.off)
    }

    /// The median over rounds of on − off, per percentile, µs.
    pub fn median_round_added_us(&self) -> Option<[i64; 4]> {
        median(&self.round_added_us())
    }

    /// On − off of the alternating runs, pooled, µs.
    pub fn alternating_added_us(&self) -> Option<[i64; 4]> {
        pooled_diff(
            self.alternating_on.as_ref()?,
            self.alternating_off.as_ref()?,
        )
    }

    /// On − off of each alternating run, µs.
    pub fn alternating_round_added_us(&self) -> Vec<[i64; 4]> {
        match (&self.alternating_on, &self.alternating_off) {
            (Some(on), Some(off)) => round_diffs(on, off),
            _ => Vec::new(),
        }
    }
}

/// Results of the tenants scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantResult {
    /// The limits the metered key and principal had.
    pub limits: MeteredLimits,
    /// One per store.
    pub stores: Vec<TenantStoreResult>,
}

/// The tenants scenario on each store, each on a fresh deployment of
/// separate processes.
pub async fn tenants(
    bins: &Binaries,
    work: &std::path::Path,
    settings: &TenantSettings,
) -> Result<TenantResult, ScenarioError> {
    let mut stores = Vec::new();
    for &store in &settings.stores {
        let mut d = Deployment::start(bins, &tenants_deployment(work, store)).await?;
        let arms = TenantArms::of(&d);
        let result = tenant_runs(&d, store, &arms, settings).await;
        let alive = d.check_alive();
        d.stop().await;
        alive?;
        stores.push(result?);
    }
    Ok(TenantResult {
        limits: MeteredLimits::default(),
        stores,
    })
}

struct ArmAcc {
    label: String,
    hist: Histogram<u64>,
    ok: u64,
    errors: BTreeMap<String, u64>,
    edge_ticks: Option<u64>,
    sent: f64,
    rounds: Vec<LoadReport>,
}

impl ArmAcc {
    fn new(label: &str) -> Self {
        ArmAcc {
            label: label.to_owned(),
            hist: load::latency_histogram(),
            ok: 0,
            errors: BTreeMap::new(),
            edge_ticks: Some(0),
            sent: 0.0,
            rounds: Vec::new(),
        }
    }

    fn result(self) -> ArmResult {
        ArmResult {
            pooled: Percentiles::of(&self.hist),
            edge_us_per_request: self
                .edge_ticks
                .map(|t| t as f64 * 1e6 / TICKS_PER_SECOND as f64 / self.sent.max(1.0)),
            label: self.label,
            ok: self.ok,
            errors: self.errors,
            rounds: self.rounds,
        }
    }
}

/// The Edge's `/status` `tenants` object (its runtime keys left out).
pub async fn tenants_status(client: &reqwest::Client, g: &dyn Gateway) -> serde_json::Value {
    let url = format!("http://{}/status", g.edge_http());
    let doc = async {
        let r = client
            .get(&url)
            .bearer_auth(API_KEY)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        serde_json::from_slice::<serde_json::Value>(&r.bytes().await.ok()?).ok()
    }
    .await;
    let mut tenants = doc.map_or(serde_json::Value::Null, |d| d["tenants"].clone());
    if let Some(t) = tenants.as_object_mut() {
        t.remove("keys");
    }
    tenants
}

/// The scenario against one gateway whose tenants' counters are on
/// `store`: `settings.rounds` rounds, each the direct baseline (when
/// there is one), then off and on, in alternating order.
pub async fn tenant_runs(
    g: &dyn Gateway,
    store: JournalStore,
    arms: &TenantArms,
    settings: &TenantSettings,
) -> Result<TenantStoreResult, ScenarioError> {
    let client = load::client()?;
    let mode = LoadMode::Open {
        rate_per_s: settings.rate_per_s,
    };
    let load_before = crate::procfs::load_average().unwrap_or_default();
    let mut direct = arms.direct.as_ref().map(|_| ArmAcc::new("direct"));
    let mut off = ArmAcc::new(OFF);
    let mut on = ArmAcc::new(ON);
    for round in 0..settings.rounds {
        eprintln!(
            "tenants ({} store): round {}/{}, open loop {}/s",
            store.as_str(),
            round + 1,
            settings.rounds,
            settings.rate_per_s
        );
        let mut order: Vec<(&mut ArmAcc, &Target)> = Vec::new();
        if let (Some(acc), Some(t)) = (direct.as_mut(), arms.direct.as_ref()) {
            order.push((acc, t));
        }
        if round % 2 == 0 {
            order.push((&mut off, &arms.off));
            order.push((&mut on, &arms.on));
        } else {
            order.push((&mut on, &arms.on));
            order.push((&mut off, &arms.off));
        }
        for (acc, target) in order {
            let spec = LoadSpec::new(&acc.label, target.clone(), false, mode, settings.round);
            let measure_cpu = acc.label != "direct";
            let before = if measure_cpu {
                g.cpu_ticks().transpose()?
            } else {
                None
            };
            let started = Instant::now();
            let (report, hist) = load::run_with_histogram(&client, &spec).await?;
            let elapsed = started.elapsed().as_secs_f64();
            match (before, g.cpu_ticks().transpose()?) {
                (Some((e0, _)), Some((e1, _))) => {
                    if let Some(t) = acc.edge_ticks.as_mut() {
                        *t += e1.saturating_sub(e0);
                    }
                }
                _ => acc.edge_ticks = None,
            }
            acc.sent += settings.rate_per_s * elapsed.min(settings.round.as_secs_f64());
            acc.hist
                .add(&hist)
                .map_err(|e| ScenarioError::Timeout(format!("pooling histograms: {e}")))?;
            acc.ok += report.ok;
            for (k, v) in &report.errors {
                *acc.errors.entry(k.clone()).or_default() += v;
            }
            eprintln!(
                "  {:<12} ok {:>7} err {:>5} p50 {} p99 {} p99.9 {} ms",
                acc.label,
                report.ok,
                report.error_count(),
                report.total.map_or("-".into(), |p| ms(p.p50_us)),
                report.total.map_or("-".into(), |p| ms(p.p99_us)),
                report.total.map_or("-".into(), |p| ms(p.p999_us)),
            );
            acc.rounds.push(report);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let (alternating_off, alternating_on) = if settings.alternating_rounds > 0 {
        let (off, on) = alternating(&client, store, arms, settings).await?;
        (Some(off), Some(on))
    } else {
        (None, None)
    };
    let status = tenants_status(&client, g).await;
    Ok(TenantStoreResult {
        alternating_off,
        alternating_on,
        store,
        mode,
        round_s: settings.round.as_secs_f64(),
        direct: direct.map(ArmAcc::result),
        off: off.result(),
        on: on.result(),
        status,
        load_avg: [
            load_before,
            crate::procfs::load_average().unwrap_or_default(),
        ],
    })
}

/// The alternating runs: off and on requests one by one,
/// `settings.rate_per_s` in all.
async fn alternating(
    client: &reqwest::Client,
    store: JournalStore,
    arms: &TenantArms,
    settings: &TenantSettings,
) -> Result<(ArmResult, ArmResult), ScenarioError> {
    let mode = LoadMode::Open {
        rate_per_s: settings.rate_per_s / 2.0,
    };
    let mut off = ArmAcc::new(OFF);
    let mut on = ArmAcc::new(ON);
    off.edge_ticks = None;
    on.edge_ticks = None;
    for round in 0..settings.alternating_rounds {
        eprintln!(
            "tenants ({} store): alternating run {}/{}, {}/s in all",
            store.as_str(),
            round + 1,
            settings.alternating_rounds,
            settings.rate_per_s
        );
        let spec =
            |label: &str, t: &Target| LoadSpec::new(label, t.clone(), false, mode, settings.round);
        // Which arm takes the even requests changes every run.
        let (specs, on_first) = if round % 2 == 0 {
            (vec![spec(OFF, &arms.off), spec(ON, &arms.on)], false)
        } else {
            (vec![spec(ON, &arms.on), spec(OFF, &arms.off)], true)
        };
        let mut results = load::run_alternating(client, &specs).await?;
        if on_first {
            results.reverse();
        }
        for (acc, (report, hist)) in [&mut off, &mut on].into_iter().zip(results) {
            acc.hist
                .add(&hist)
                .map_err(|e| ScenarioError::Timeout(format!("pooling histograms: {e}")))?;
            acc.ok += report.ok;
            for (k, v) in &report.errors {
                *acc.errors.entry(k.clone()).or_default() += v;
            }
            eprintln!(
                "  {:<12} ok {:>7} err {:>5} p50 {} p99 {} p99.9 {} ms",
                acc.label,
                report.ok,
                report.error_count(),
                report.total.map_or("-".into(), |p| ms(p.p50_us)),
                report.total.map_or("-".into(), |p| ms(p.p99_us)),
                report.total.map_or("-".into(), |p| ms(p.p999_us)),
            );
            acc.rounds.push(report);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok((off.result(), on.result()))
}

fn cell(p: Option<Percentiles>, i: usize) -> String {
    p.map_or_else(|| "-".into(), |p| ms(p.quantiles_us()[i]))
}

fn signed_cells(d: Option<[i64; 4]>) -> [String; 4] {
    std::array::from_fn(|i| d.map_or_else(|| "-".into(), |d| ms_signed(d[i])))
}

fn errors_cell(e: &BTreeMap<String, u64>) -> String {
    if e.is_empty() {
        "0".into()
    } else {
        e.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl TenantResult {
    /// The scenario's tables.
    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "## Tenants: limits and budgets on vs off (non-streaming, 8-token answers; ms)\n\n\
             Same Edge, same provider, rounds alternating which arm goes first; \
             percentiles of every round's measured window pooled per arm. *off*: a key \
             whose principal has no limit, no budget, no price; *on*: a key with \
             requests, tokens and concurrency limits, its principal with those and a \
             daily budget, the model priced (all far above the load: nothing refused).\n\n\
             | store | load | rounds × s | arm | ok | errors | p50 | p90 | p99 | p99.9 | Edge µs/request |\n\
             | --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for s in &self.stores {
            for arm in s.direct.iter().chain([&s.off, &s.on]) {
                out.push_str(&format!(
                    "| {} | {} | {} × {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    s.store.as_str(),
                    s.mode.label(),
                    arm.rounds.len(),
                    s.round_s,
                    arm.label,
                    arm.ok,
                    errors_cell(&arm.errors),
                    cell(arm.pooled, 0),
                    cell(arm.pooled, 1),
                    cell(arm.pooled, 2),
                    cell(arm.pooled, 3),
                    arm.edge_us_per_request
                        .map_or_else(|| "-".into(), |us| format!("{us:.1}")),
                ));
            }
        }
        out.push_str(
            "\n### On − off (ms; pooled, and the median of the rounds' differences)\n\n\
             | store | p50 | p90 | p99 | p99.9 | median round p50 | median round p99 | median round p99.9 | p99 on / off | Edge µs/request on − off | load avg |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
        );
        for s in &self.stores {
            let pooled = signed_cells(s.added_us());
            let median = signed_cells(s.median_round_added_us());
            let ratio = match (s.on.pooled, s.off.pooled) {
                (Some(on), Some(off)) if off.p99_us > 0 => {
                    format!("{:.3}", on.p99_us as f64 / off.p99_us as f64)
                }
                _ => "-".into(),
            };
            let cpu = match (s.on.edge_us_per_request, s.off.edge_us_per_request) {
                (Some(a), Some(b)) => format!("{:+.1}", a - b),
                _ => "-".into(),
            };
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} → {:.1} |\n",
                s.store.as_str(),
                pooled[0],
                pooled[1],
                pooled[2],
                pooled[3],
                median[0],
                median[2],
                median[3],
                ratio,
                cpu,
                s.load_avg[0][0],
                s.load_avg[1][0],
            ));
        }
        out.push_str("\n### Per round, on − off (ms: p50 / p99 / p99.9)\n\n| store | rounds |\n| --- | --- |\n");
        for s in &self.stores {
            let rounds: Vec<String> = s
                .round_added_us()
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let first = if i % 2 == 0 { "off first" } else { "on first" };
                    format!(
                        "{} / {} / {} ({first})",
                        ms_signed(d[0]),
                        ms_signed(d[2]),
                        ms_signed(d[3])
                    )
                })
                .collect();
            out.push_str(&format!(
                "| {} | {} |\n",
                s.store.as_str(),
                rounds.join("; ")
            ));
        }
        if self.stores.iter().any(|s| s.alternating_on.is_some()) {
            out.push_str(
                "\n### Requests alternating one by one (off, on, off, on, ...; ms)\n\n\
                 One open loop at the scenario's rate in all, each arm half of it, so both \
                 arms see the same moments of the machine; runs pooled per arm.\n\n\
                 | store | load per arm | runs × s | ok off / on | errors off / on | off p50 | on p50 | off p99 | on p99 | off p99.9 | on p99.9 | **on − off p50** | **on − off p99** | on − off p99.9 | per run on − off p50 / p99 |\n\
                 | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
            );
            for s in &self.stores {
                let (Some(off), Some(on)) = (&s.alternating_off, &s.alternating_on) else {
                    continue;
                };
                let d = signed_cells(s.alternating_added_us());
                let runs: Vec<String> = s
                    .alternating_round_added_us()
                    .iter()
                    .map(|r| format!("{} / {}", ms_signed(r[0]), ms_signed(r[2])))
                    .collect();
                let per_arm = on.rounds.first().map_or("-".into(), |r| r.mode.label());
                out.push_str(&format!(
                    "| {} | {} | {} × {:.0} | {} / {} | {} / {} | {} | {} | {} | {} | {} | {} | **{}** | **{}** | {} | {} |\n",
                    s.store.as_str(),
                    per_arm,
                    on.rounds.len(),
                    s.round_s,
                    off.ok,
                    on.ok,
                    errors_cell(&off.errors),
                    errors_cell(&on.errors),
                    cell(off.pooled, 0),
                    cell(on.pooled, 0),
                    cell(off.pooled, 2),
                    cell(on.pooled, 2),
                    cell(off.pooled, 3),
                    cell(on.pooled, 3),
                    d[0],
                    d[2],
                    d[3],
                    runs.join("; "),
                ));
            }
        }
        out.push_str("\n### The tenants' store after the runs (`/status` `tenants`)\n\n");
        for s in &self.stores {
            let t = &s.status;
            let spend = &t["today"]["principals"][METERED_PRINCIPAL];
            out.push_str(&format!(
                "- {}: store reachable {}, claims {}, claim failures {}, usage writes {} (failed {}); \
                 today's `{METERED_PRINCIPAL}` usage {}\n",
                s.store.as_str(),
                t["store_reachable"],
                t["claims"],
                t["claim_failures"],
                t["usage_writes"],
                t["usage_write_failures"],
                spend,
            ));
        }
        out.push('\n');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metered_config_names_its_key_principal_price_and_route() {
        let mut toml = crate::deployment::edge_config_head(1, 2, 3);
        let extras = metered_extras(
            "short-metered",
            &["short-norm-n1".to_owned()],
            &MeteredLimits::default(),
            JournalStore::Nats,
        );
        JournalStore::Nats
            .add_to_edge_config_with(&mut toml, Some("nats://127.0.0.1:4222"), &extras)
            .unwrap();
        toml.push_str(&extras.tables);
        assert!(
            toml.contains(
                "[journal]\nstore = \"nats\"\nmax_bytes = 16777216\n[journal.nats]\nservers = [\"nats://127.0.0.1:4222\"]\ntenant_bucket_max_bytes = 8388608\n"
            ),
            "{toml}"
        );
        assert!(toml.contains("key_file = \"api-key-metered\""), "{toml}");
        assert!(toml.contains("budget_period = \"day\""), "{toml}");
        assert!(
            toml.contains(
                "[[routes]]\nmodel = \"short-metered\"\nproviders = [\"short-norm-n1\"]\n"
            ),
            "{toml}"
        );
        assert_eq!(extras.key_files.len(), 1);
        // The embedded store's journal is left as it is.
        let embedded = metered_extras("m", &[], &MeteredLimits::default(), JournalStore::Embedded);
        assert!(embedded.journal.is_empty() && embedded.nats.is_empty());
    }
}
