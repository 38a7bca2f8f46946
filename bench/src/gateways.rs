//! The gateways scenario (issue 42): what the published gateway
//! benchmarks report, for the mock provider alone (direct), iop in tunnel
//! and in normalized mode, and peer gateways ([`crate::peers`]: Portkey's
//! open-source gateway, LiteLLM's proxy) in front of the same mock
//! process, in one run:
//!
//! * one request at a time (closed loop, one client): p50 and p99 of a
//!   non-streamed request, and the time to first token and the gap
//!   between chunks of a streamed one;
//! * the most requests per second with p99 under a bound (20 ms): closed
//!   loop at 1, 2, 4, ... clients until p99 reaches the bound (or a
//!   request fails), the best rate of the steps under it;
//! * added latency in open loop at fixed rates (1,000 and 2,000 requests/s),
//!   each offered only to the paths whose rate search reached it with
//!   [`OPEN_RATE_HEADROOM`] to spare in the same run (a gateway's queue
//!   past its rate would measure only itself, take the CPUs from the
//!   others, and leave its backlog of connections on the shared mock for
//!   the next path);
//! * the peak resident memory (`VmHWM`) of each gateway's processes.
//!
//! Added = path minus direct of the same run. The scenario runs several
//! times ([`GatewaySettings::runs`]) and reports each figure's median over
//! the runs and every run's value; within a run each measurement goes
//! through every path in an order that rotates from run to run, so no path
//! always goes first. The machine's load averages are read before and
//! after each run.
//!
//! iop can be deployed more than once with different `[runtime]
//! worker_threads` ([`GatewaySettings::worker_threads`]), all deployments
//! running side by side against the first one's mock: its paths then
//! alternate with each other in every measurement (A B A B), which is how
//! a runtime is compared with another.
//!
//! Likewise with different `[quic]` settings
//! ([`GatewaySettings::quic`], [`QuicVariant`]): one deployment per
//! variant (and per runtime), so quinn's transport settings are compared
//! with its defaults in the same rotation.
//!
//! Another build of iop can be measured in the same run beside this one
//! ([`GatewaySettings::baseline`]: the `iop-edge` and `iop-node` of, say,
//! the commit before a change): one more deployment per runtime, its
//! paths labelled `(baseline)`, in the same rotation as every other path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::deployment::{Binaries, Deployment};
use crate::gateway::{SHORT_MOCK, ScenarioError, latency_deployment};
use crate::load::{self, LoadSpec, Target};
use crate::peers::{self, PeerKind, RunningPeer, SkippedPeer};
use crate::procfs;
use crate::report::{LoadMode, LoadReport, ms, ms_signed};

/// The label of the baseline path.
pub const DIRECT: &str = "direct";
/// The most closed-loop clients the rate search tries.
pub const MAX_CONCURRENCY_LIMIT: u32 = 4096;
/// Runs of the scenario at most.
pub const MAX_RUNS: usize = 20;

/// Settings of the gateways scenario.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// Times the whole scenario runs (each figure: the median of these).
    pub runs: usize,
    /// Length of each one-request-at-a-time measurement, warm-up included.
    pub duration: Duration,
    /// Length of each step of the rate search, warm-up included.
    pub step_duration: Duration,
    /// The p99 the rate search stays under.
    pub p99_bound: Duration,
    /// The most clients the rate search tries.
    pub max_concurrency: u32,
    /// Open-loop rates offered after the rate search, each to the paths
    /// whose best rate under the bound in the same run reached it.
    pub open_rates: Vec<f64>,
    /// One iop deployment per entry, its `[runtime] worker_threads`
    /// (`None`: the default, no `[runtime]`).
    pub worker_threads: Vec<Option<usize>>,
    /// One iop deployment per entry (and per entry of
    /// [`GatewaySettings::worker_threads`]), its `[quic]` table (`None`:
    /// the default, no `[quic]`).
    pub quic: Vec<Option<QuicVariant>>,
    /// Another build's binaries, deployed once more per entry of
    /// [`GatewaySettings::worker_threads`] beside this build's and
    /// measured in the same run (`None`: this build only).
    pub baseline: Option<Binaries>,
    /// The peers to measure, with the program that runs each (`None`: not
    /// installed; the peer is reported as skipped).
    pub peers: Vec<(PeerKind, Option<PathBuf>)>,
    /// The pause after each measurement, so sockets in `TIME_WAIT` and
    /// queued work drain ([`PAUSE`]).
    pub pause: Duration,
}

/// How far past an open-loop rate a path's rate search must have reached
/// for the path to be offered that rate: a gateway offered a rate it
/// sustains only just falls behind, and what it leaves queued on the
/// shared mock spoils the next path's measurement.
pub const OPEN_RATE_HEADROOM: f64 = 1.25;

/// Is `rate` offered in open loop to a path whose rate search took
/// `steps`: its best step under `bound` reached [`OPEN_RATE_HEADROOM`]
/// times it.
fn offered(steps: &[LoadReport], bound: Duration, rate: f64) -> bool {
    best_step(steps, bound).is_some_and(|r| r.throughput_rps >= rate * OPEN_RATE_HEADROOM)
}

/// The usual pause between measurements.
pub const PAUSE: Duration = Duration::from_millis(300);

impl GatewaySettings {
    fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |what: &str| Err(ScenarioError::Timeout(format!("gateways: {what}")));
        if self.runs == 0 || self.runs > MAX_RUNS {
            return bad("runs must be 1..=20");
        }
        if self.max_concurrency == 0 || self.max_concurrency > MAX_CONCURRENCY_LIMIT {
            return bad("max concurrency must be 1..=4096");
        }
        if self.worker_threads.is_empty() || self.quic.is_empty() {
            return bad("at least one iop deployment");
        }
        Ok(())
    }
}

/// One path the scenario measures.
#[derive(Debug, Clone)]
pub struct GatewayPath {
    /// Its label (`direct`, `iop tunnel`, `portkey`, ...).
    pub label: String,
    /// Where its requests go.
    pub target: Target,
}

/// What one run measured through one path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathRun {
    /// The path.
    pub label: String,
    /// Non-streamed requests, one client.
    pub single: LoadReport,
    /// Streamed requests, one client.
    pub single_stream: LoadReport,
    /// The rate search: closed loop at 1, 2, 4, ... clients.
    pub steps: Vec<LoadReport>,
    /// The most requests/s of a step with p99 under the bound and no
    /// failed request; 0 when no step was (not even one client).
    pub max_rps: Option<f64>,
    /// The clients of that step.
    pub max_rps_concurrency: Option<u32>,
    /// Non-streamed requests in open loop at each of
    /// [`GatewaySettings::open_rates`] the path sustained in this run's
    /// rate search (the others are not offered).
    #[serde(default)]
    pub open: Vec<LoadReport>,
}

/// One run of the scenario: every path, every measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GatewaysRun {
    /// Load averages (1, 5, 15 min) before the run.
    pub load_avg_before: [f64; 3],
    /// Load averages after it.
    pub load_avg_after: [f64; 3],
    /// One entry per path, the direct path first.
    pub paths: Vec<PathRun>,
}

/// The peak resident memory of one gateway's processes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeakRss {
    /// The gateway (`mock (direct)`, `iop`, `portkey`, ...).
    pub gateway: String,
    /// The paths it serves.
    pub paths: Vec<String>,
    /// Its processes, their children included.
    pub processes: usize,
    /// The sum of their `VmHWM` at the end, bytes.
    pub bytes: u64,
}

/// A figure over the runs: its median and each run's value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// The median of `runs` (of the two middle values when even).
    pub median: f64,
    /// Each run's value, in run order.
    pub runs: Vec<f64>,
}

impl Figure {
    /// The figure of `values`; `None` when there is none.
    pub fn of(values: Vec<f64>) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        let mut sorted = values.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Self {
            median,
            runs: values,
        })
    }
}

/// One path's figures over the runs (µs unless named otherwise; added =
/// path minus direct of the same run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathSummary {
    /// The path.
    pub label: String,
    /// p50 of a non-streamed request, one client.
    pub p50_us: Option<Figure>,
    /// Its p99.
    pub p99_us: Option<Figure>,
    /// Added p50.
    pub added_p50_us: Option<Figure>,
    /// Added p99.
    pub added_p99_us: Option<Figure>,
    /// p99 of the time to first token of a streamed request, one client.
    pub ttft_p99_us: Option<Figure>,
    /// Its added p99.
    pub added_ttft_p99_us: Option<Figure>,
    /// p50 of the gap between chunks of one stream.
    pub gap_p50_us: Option<Figure>,
    /// Its p99.
    pub gap_p99_us: Option<Figure>,
    /// Added p99 of the gap.
    pub added_gap_p99_us: Option<Figure>,
    /// The most requests/s with p99 under the bound.
    pub max_rps: Option<Figure>,
    /// Added p50 and p99 in open loop, per offered rate.
    #[serde(default)]
    pub open: Vec<OpenSummary>,
}

/// A path's added latency at one open-loop rate, over the runs that
/// offered it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenSummary {
    /// Requests per second offered.
    pub rate_per_s: f64,
    /// Added p50, µs.
    pub added_p50_us: Option<Figure>,
    /// Added p99, µs.
    pub added_p99_us: Option<Figure>,
}

/// Results of the gateways scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GatewaysResult {
    /// The p99 bound of the rate search, ms.
    pub p99_bound_ms: f64,
    /// Length of each one-client measurement, seconds.
    pub duration_s: f64,
    /// Length of each step of the rate search, seconds.
    pub step_duration_s: f64,
    /// Peers that were not measured, and why.
    pub skipped: Vec<SkippedPeer>,
    /// Every run.
    pub runs: Vec<GatewaysRun>,
    /// Each path's figures over the runs.
    pub summary: Vec<PathSummary>,
    /// Each gateway's peak memory, read after the last run.
    pub peak_rss: Vec<PeakRss>,
}

/// A `[quic]` table an iop deployment runs with: its label and its
/// body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuicVariant {
    /// As given: `name=value` settings joined by `+`
    /// (`ack_eliciting_threshold=0`, `congestion=bbr+initial_window=64000`).
    pub label: String,
    /// The table's body, one `name = value` per line.
    pub body: String,
}

impl QuicVariant {
    /// `default` (no `[quic]`: `None`) or `name=value` settings joined by
    /// `+`; a value that is neither a number nor `true`/`false` is written
    /// as a TOML string. The binaries validate the settings themselves.
    pub fn parse(text: &str) -> Result<Option<Self>, String> {
        if text == "default" {
            return Ok(None);
        }
        let mut body = String::new();
        for setting in text.split('+') {
            let Some((name, value)) = setting.split_once('=') else {
                return Err(format!("`{setting}` is not name=value"));
            };
            let word = |s: &str| {
                !s.is_empty()
                    && s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            };
            if !word(name) || !word(value) {
                return Err(format!("`{setting}`: name and value are [A-Za-z0-9_.]+"));
            }
            let literal = value == "true" || value == "false" || value.parse::<f64>().is_ok();
            if literal {
                body.push_str(&format!("{name} = {value}\n"));
            } else {
                body.push_str(&format!("{name} = \"{value}\"\n"));
            }
        }
        Ok(Some(Self {
            label: text.to_owned(),
            body,
        }))
    }
}

/// The suffix of an iop deployment's labels: none for this build's
/// default runtime and `[quic]`; the runtime and the `[quic]` variant when
/// set, and `baseline` for the other build's deployments.
pub fn runtime_suffix(
    worker_threads: Option<usize>,
    quic: Option<&QuicVariant>,
    baseline: bool,
) -> String {
    let runtime = match worker_threads {
        None => None,
        Some(0) => Some("a worker per CPU".to_owned()),
        Some(1) => Some("1 thread".to_owned()),
        Some(n) => Some(format!("{n} workers")),
    };
    let parts: Vec<String> = runtime
        .into_iter()
        .chain(quic.map(|q| q.label.clone()))
        .chain(baseline.then(|| "baseline".to_owned()))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// Deploy the mock, one iop per [`GatewaySettings::worker_threads`] (and
/// as many of the baseline build) and the peers, then [`measure`] every
/// path.
pub async fn gateways(
    bins: &Binaries,
    work: &Path,
    settings: &GatewaySettings,
) -> Result<GatewaysResult, ScenarioError> {
    settings.validate()?;
    // (label suffix, deployment)
    let mut deployments: Vec<(String, Deployment)> = Vec::new();
    let mut mock = None;
    let builds = std::iter::once((bins, false)).chain(settings.baseline.iter().map(|b| (b, true)));
    type Planned<'a> = (&'a Binaries, bool, Option<usize>, Option<&'a QuicVariant>);
    let planned: Vec<Planned<'_>> = builds
        .flat_map(|(b, baseline)| {
            settings.worker_threads.iter().flat_map(move |&threads| {
                settings
                    .quic
                    .iter()
                    .map(move |quic| (b, baseline, threads, quic.as_ref()))
            })
        })
        .collect();
    for (i, (build, baseline, threads, quic)) in planned.into_iter().enumerate() {
        let mut spec = latency_deployment(work, mock);
        spec.mocks.retain(|m| m.name == SHORT_MOCK);
        spec.dir = work.join(format!("gateways-iop-{i}"));
        spec.worker_threads = threads;
        spec.quic = quic.map(|q| q.body.clone());
        let started = Deployment::start(build, &spec).await;
        let d = match started {
            Ok(d) => d,
            Err(e) => {
                stop_all(deployments, Vec::new()).await;
                return Err(e.into());
            }
        };
        mock = mock.or_else(|| d.mocks.first().map(|m| m.addr));
        deployments.push((runtime_suffix(threads, quic, baseline), d));
    }
    let (Some(mock), Some((_, first))) = (mock, deployments.first()) else {
        return Err(ScenarioError::Timeout("gateways: no deployment".into()));
    };
    let mock_pids: Vec<u32> = first
        .mocks
        .iter()
        .filter_map(|m| m.proc.as_ref().map(crate::deployment::Proc::pid))
        .collect();
    let Some(direct) = first.direct(SHORT_MOCK) else {
        return Err(ScenarioError::Timeout("gateways: no direct path".into()));
    };
    let mut running: Vec<RunningPeer> = Vec::new();
    let mut skipped = Vec::new();
    for (kind, program) in &settings.peers {
        let dir = work.join("gateways-peers").join(kind.as_str());
        eprintln!("gateways: starting {}", kind.as_str());
        match peers::start(*kind, program.as_deref(), mock, &dir).await {
            Ok(peer) => running.push(peer),
            Err(skip) => {
                eprintln!("gateways: {} skipped: {}", kind.as_str(), skip.reason);
                skipped.push(skip);
            }
        }
    }
    let mut paths = vec![GatewayPath {
        label: DIRECT.into(),
        target: direct,
    }];
    // (gateway, its paths, its root processes)
    let mut groups: Vec<(String, Vec<String>, Vec<u32>)> =
        vec![("mock (direct)".into(), vec![DIRECT.into()], mock_pids)];
    for (suffix, d) in &deployments {
        let labels = [
            format!("iop tunnel{suffix}"),
            format!("iop normalized{suffix}"),
        ];
        paths.push(GatewayPath {
            label: labels[0].clone(),
            target: d.via(SHORT_MOCK, true),
        });
        paths.push(GatewayPath {
            label: labels[1].clone(),
            target: d.via(SHORT_MOCK, false),
        });
        let mut pids = vec![d.edge.pid()];
        pids.extend(d.nodes.iter().map(crate::deployment::Proc::pid));
        groups.push((format!("iop{suffix}"), labels.to_vec(), pids));
    }
    for peer in &running {
        paths.push(GatewayPath {
            label: peer.kind.as_str().into(),
            target: peer.target.clone(),
        });
        groups.push((
            peer.kind.as_str().into(),
            vec![peer.kind.as_str().into()],
            vec![peer.proc.pid()],
        ));
    }
    let measured = measure(&paths, settings).await;
    let peak_rss = groups
        .into_iter()
        .map(|(gateway, paths, pids)| {
            let tree: Vec<u32> = pids.iter().flat_map(|p| procfs::process_tree(*p)).collect();
            let bytes = tree
                .iter()
                .filter_map(|p| procfs::peak_rss_bytes(*p).ok())
                .sum();
            PeakRss {
                gateway,
                paths,
                processes: tree.len(),
                bytes,
            }
        })
        .collect();
    let mut alive = Ok(());
    for (_, d) in &mut deployments {
        if alive.is_ok() {
            alive = d.check_alive();
        }
    }
    stop_all(deployments, running).await;
    alive?;
    let runs = measured?;
    Ok(GatewaysResult {
        p99_bound_ms: settings.p99_bound.as_secs_f64() * 1e3,
        duration_s: settings.duration.as_secs_f64(),
        step_duration_s: settings.step_duration.as_secs_f64(),
        skipped,
        summary: summarize(&runs),
        runs,
        peak_rss,
    })
}

async fn stop_all(deployments: Vec<(String, Deployment)>, peers: Vec<RunningPeer>) {
    for peer in peers {
        peer.proc.stop().await;
    }
    // The first deployment owns the mock the others use: stop it last.
    for (_, d) in deployments.into_iter().rev() {
        d.stop().await;
    }
}

/// Run the scenario's measurements through `paths` (the direct baseline
/// first) [`GatewaySettings::runs`] times.
pub async fn measure(
    paths: &[GatewayPath],
    settings: &GatewaySettings,
) -> Result<Vec<GatewaysRun>, ScenarioError> {
    settings.validate()?;
    let client = load::client()?;
    let mut runs = Vec::new();
    for run in 0..settings.runs {
        let load_avg_before = procfs::load_average().unwrap_or_default();
        eprintln!(
            "gateways: run {} of {} (load {:.2} {:.2} {:.2})",
            run + 1,
            settings.runs,
            load_avg_before[0],
            load_avg_before[1],
            load_avg_before[2]
        );
        let n = paths.len();
        let order: Vec<usize> = (0..n).map(|k| (k + run) % n).collect();
        let mut single: Vec<Option<LoadReport>> = vec![None; n];
        let mut single_stream: Vec<Option<LoadReport>> = vec![None; n];
        let mut steps: Vec<Vec<LoadReport>> = vec![Vec::new(); n];
        for &i in &order {
            let mode = LoadMode::Closed { concurrency: 1 };
            let spec = LoadSpec::new(
                &paths[i].label,
                paths[i].target.clone(),
                false,
                mode,
                settings.duration,
            );
            single[i] = Some(timed_run(&client, &spec, settings.pause).await?);
        }
        for &i in &order {
            let mode = LoadMode::Closed { concurrency: 1 };
            let spec = LoadSpec::new(
                &paths[i].label,
                paths[i].target.clone(),
                true,
                mode,
                settings.duration,
            );
            single_stream[i] = Some(timed_run(&client, &spec, settings.pause).await?);
        }
        for &i in &order {
            steps[i] = rate_search(&client, &paths[i], settings).await?;
        }
        let mut open: Vec<Vec<LoadReport>> = vec![Vec::new(); n];
        for &rate in &settings.open_rates {
            for &i in &order {
                if !offered(&steps[i], settings.p99_bound, rate) {
                    continue;
                }
                let mode = LoadMode::Open { rate_per_s: rate };
                let spec = LoadSpec::new(
                    &paths[i].label,
                    paths[i].target.clone(),
                    false,
                    mode,
                    settings.duration,
                );
                open[i].push(timed_run(&client, &spec, settings.pause).await?);
            }
        }
        let load_avg_after = procfs::load_average().unwrap_or_default();
        let mut out = Vec::new();
        for (i, path) in paths.iter().enumerate() {
            let (Some(single), Some(single_stream)) = (single[i].take(), single_stream[i].take())
            else {
                return Err(ScenarioError::Timeout(format!(
                    "gateways: {} was not measured",
                    path.label
                )));
            };
            let best = best_step(&steps[i], settings.p99_bound);
            out.push(PathRun {
                label: path.label.clone(),
                single,
                single_stream,
                max_rps: Some(best.map_or(0.0, |r| r.throughput_rps)),
                max_rps_concurrency: best.and_then(|r| match r.mode {
                    LoadMode::Closed { concurrency } => Some(concurrency),
                    LoadMode::Open { .. } => None,
                }),
                steps: std::mem::take(&mut steps[i]),
                open: std::mem::take(&mut open[i]),
            });
        }
        runs.push(GatewaysRun {
            load_avg_before,
            load_avg_after,
            paths: out,
        });
    }
    Ok(runs)
}

/// One load run, its line on stderr, then `pause`.
async fn timed_run(
    client: &reqwest::Client,
    spec: &LoadSpec,
    pause: Duration,
) -> Result<LoadReport, ScenarioError> {
    let r = load::run(client, spec).await?;
    let pct = |p: Option<crate::report::Percentiles>, f: fn(&crate::report::Percentiles) -> u64| {
        p.as_ref().map_or("-".into(), |p| ms(f(p)))
    };
    eprintln!(
        "  {:<28} {:<10} {:<6} ok {:>7} err {:>5} rps {:>8.0} p50 {} p99 {} TTFT p99 {} ms",
        spec.label,
        spec.mode.label(),
        if spec.stream { "stream" } else { "" },
        r.ok,
        r.error_count(),
        r.throughput_rps,
        pct(r.total, |p| p.p50_us),
        pct(r.total, |p| p.p99_us),
        pct(r.ttft, |p| p.p99_us),
    );
    tokio::time::sleep(pause).await;
    Ok(r)
}

/// Does a step count for the rate search: no failed request, and p99
/// under the bound?
fn under_bound(r: &LoadReport, bound: Duration) -> bool {
    r.error_count() == 0
        && r.ok > 0
        && r.total
            .is_some_and(|p| u128::from(p.p99_us) < bound.as_micros())
}

/// The step with the most requests/s among those under the bound.
fn best_step(steps: &[LoadReport], bound: Duration) -> Option<&LoadReport> {
    steps
        .iter()
        .filter(|r| under_bound(r, bound))
        .max_by(|a, b| a.throughput_rps.total_cmp(&b.throughput_rps))
}

/// Closed loop at 1, 2, 4, ... clients through `path` until a step is
/// not under the bound or [`GatewaySettings::max_concurrency`] is passed.
async fn rate_search(
    client: &reqwest::Client,
    path: &GatewayPath,
    settings: &GatewaySettings,
) -> Result<Vec<LoadReport>, ScenarioError> {
    let mut steps = Vec::new();
    let mut concurrency = 1;
    while concurrency <= settings.max_concurrency {
        let mode = LoadMode::Closed { concurrency };
        let spec = LoadSpec::new(
            &path.label,
            path.target.clone(),
            false,
            mode,
            settings.step_duration,
        );
        let r = timed_run(client, &spec, settings.pause).await?;
        let go_on = under_bound(&r, settings.p99_bound);
        steps.push(r);
        if !go_on {
            break;
        }
        concurrency *= 2;
    }
    Ok(steps)
}

/// Each path's figures over `runs` (added: against the run's direct
/// path, the first).
pub fn summarize(runs: &[GatewaysRun]) -> Vec<PathSummary> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let us = |v: u64| v as f64;
    first
        .paths
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let label = p.label.clone();
            let is_direct = i == 0;
            // A figure of every run where both the path's and the
            // baseline's value exist.
            let pick = |f: &dyn Fn(&PathRun) -> Option<f64>, added: bool| {
                let values = runs
                    .iter()
                    .filter_map(|run| {
                        let own = f(run.paths.get(i)?)?;
                        if added {
                            Some(own - f(run.paths.first()?)?)
                        } else {
                            Some(own)
                        }
                    })
                    .collect();
                if added && is_direct {
                    None
                } else {
                    Figure::of(values)
                }
            };
            let p50 = |r: &PathRun| r.single.total.map(|p| us(p.p50_us));
            let p99 = |r: &PathRun| r.single.total.map(|p| us(p.p99_us));
            let ttft99 = |r: &PathRun| r.single_stream.ttft.map(|p| us(p.p99_us));
            let gap50 = |r: &PathRun| r.single_stream.gap.map(|p| us(p.p50_us));
            let gap99 = |r: &PathRun| r.single_stream.gap.map(|p| us(p.p99_us));
            PathSummary {
                label,
                p50_us: pick(&p50, false),
                p99_us: pick(&p99, false),
                added_p50_us: pick(&p50, true),
                added_p99_us: pick(&p99, true),
                ttft_p99_us: pick(&ttft99, false),
                added_ttft_p99_us: pick(&ttft99, true),
                gap_p50_us: pick(&gap50, false),
                gap_p99_us: pick(&gap99, false),
                added_gap_p99_us: pick(&gap99, true),
                max_rps: pick(&|r: &PathRun| r.max_rps, false),
                open: if is_direct {
                    Vec::new()
                } else {
                    open_summaries(runs, i)
                },
            }
        })
        .collect()
}

/// Path `i`'s added p50 and p99 at every open-loop rate any run offered
/// it, against the direct path's run at the same rate.
fn open_summaries(runs: &[GatewaysRun], i: usize) -> Vec<OpenSummary> {
    let mut rates: Vec<f64> = runs
        .iter()
        .filter_map(|run| run.paths.get(i))
        .flat_map(|p| p.open.iter().filter_map(open_rate))
        .collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    rates
        .into_iter()
        .map(|rate| {
            let added = |q: fn(&crate::report::Percentiles) -> u64| {
                let values = runs
                    .iter()
                    .filter_map(|run| {
                        let at = |p: &PathRun| {
                            p.open
                                .iter()
                                .find(|r| open_rate(r) == Some(rate))
                                .and_then(|r| r.total)
                                .map(|t| q(&t) as f64)
                        };
                        Some(at(run.paths.get(i)?)? - at(run.paths.first()?)?)
                    })
                    .collect();
                Figure::of(values)
            };
            OpenSummary {
                rate_per_s: rate,
                added_p50_us: added(|p| p.p50_us),
                added_p99_us: added(|p| p.p99_us),
            }
        })
        .collect()
}

fn open_rate(r: &LoadReport) -> Option<f64> {
    match r.mode {
        LoadMode::Open { rate_per_s } => Some(rate_per_s),
        LoadMode::Closed { .. } => None,
    }
}

fn ms_cell(f: Option<&Figure>) -> String {
    f.map_or_else(|| "-".into(), |f| ms(f.median.max(0.0) as u64))
}

fn added_cell(f: Option<&Figure>) -> String {
    f.map_or_else(|| "-".into(), |f| ms_signed(f.median as i64))
}

fn added_runs_cell(f: Option<&Figure>) -> String {
    f.map_or_else(
        || "-".into(),
        |f| {
            f.runs
                .iter()
                .map(|v| ms_signed(*v as i64))
                .collect::<Vec<_>>()
                .join(", ")
        },
    )
}

fn rps_cell(f: Option<&Figure>) -> String {
    f.map_or_else(|| "-".into(), |f| format!("{:.0}", f.median))
}

impl GatewaysResult {
    /// Per path and measurement (`one client`, `one client, streamed`,
    /// `rate search`), the failed requests of every run together; only
    /// those with any.
    pub fn failed_requests(&self) -> Vec<(String, &'static str, BTreeMap<String, u64>)> {
        let mut out: Vec<(String, &'static str, BTreeMap<String, u64>)> = Vec::new();
        for run in &self.runs {
            for p in &run.paths {
                let cells = [
                    ("one client", std::slice::from_ref(&p.single)),
                    (
                        "one client, streamed",
                        std::slice::from_ref(&p.single_stream),
                    ),
                    ("rate search", p.steps.as_slice()),
                    ("open loop", p.open.as_slice()),
                ];
                for (cell, reports) in cells {
                    for r in reports.iter().filter(|r| !r.errors.is_empty()) {
                        let i = match out.iter().position(|(l, c, _)| *l == p.label && *c == cell) {
                            Some(i) => i,
                            None => {
                                out.push((p.label.clone(), cell, BTreeMap::new()));
                                out.len() - 1
                            }
                        };
                        for (k, v) in &r.errors {
                            *out[i].2.entry(k.clone()).or_default() += v;
                        }
                    }
                }
            }
        }
        out
    }

    /// The tables: figures (medians), each run's values, memory, the
    /// machine's load and the peers skipped.
    pub fn markdown(&self) -> String {
        let runs = self.runs.len();
        let bound = self.p99_bound_ms;
        let mut out = format!(
            "## Gateways: one request at a time, and the most requests/s with p99 under {bound:.0} ms\n\n\
             Median of {runs} run(s), ms; added = path minus direct of the same run; one client \
             ({:.0} s each) for the latencies, closed loop at 1, 2, 4, ... clients ({:.0} s each) \
             for the rate.\n\n\
             | target | p50 | p99 | added p50 | added p99 | TTFT p99 | added TTFT p99 | gap p50 | gap p99 | added gap p99 | max rps (p99 < {bound:.0} ms) | peak RSS MiB |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
            self.duration_s, self.step_duration_s
        );
        for s in &self.summary {
            let rss = self
                .peak_rss
                .iter()
                .find(|r| r.paths.contains(&s.label))
                .map_or_else(
                    || "-".into(),
                    |r| format!("{:.1}", r.bytes as f64 / (1024.0 * 1024.0)),
                );
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                s.label,
                ms_cell(s.p50_us.as_ref()),
                ms_cell(s.p99_us.as_ref()),
                added_cell(s.added_p50_us.as_ref()),
                added_cell(s.added_p99_us.as_ref()),
                ms_cell(s.ttft_p99_us.as_ref()),
                added_cell(s.added_ttft_p99_us.as_ref()),
                ms_cell(s.gap_p50_us.as_ref()),
                ms_cell(s.gap_p99_us.as_ref()),
                added_cell(s.added_gap_p99_us.as_ref()),
                rps_cell(s.max_rps.as_ref()),
                rss,
            ));
        }
        out.push_str(
            "\nEach run's value (ms; requests/s):\n\n\
             | target | added p50 | added p99 | added TTFT p99 | max rps |\n\
             | --- | --- | --- | --- | --- |\n",
        );
        for s in &self.summary {
            let rps = s.max_rps.as_ref().map_or_else(
                || "-".into(),
                |f| {
                    f.runs
                        .iter()
                        .map(|v| format!("{v:.0}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            );
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                s.label,
                added_runs_cell(s.added_p50_us.as_ref()),
                added_runs_cell(s.added_p99_us.as_ref()),
                added_runs_cell(s.added_ttft_p99_us.as_ref()),
                rps,
            ));
        }
        let rates: Vec<f64> = {
            let mut r: Vec<f64> = self
                .summary
                .iter()
                .flat_map(|s| s.open.iter().map(|o| o.rate_per_s))
                .collect();
            r.sort_by(f64::total_cmp);
            r.dedup();
            r
        };
        if !rates.is_empty() {
            out.push_str(
                "\nOpen loop, non-streamed (added ms, median of the runs that offered the rate: \
                 a path is offered a rate only when its rate search reached 1.25 times it in the \
                 same run; \
                 each run's value in brackets):\n\n| target |",
            );
            for r in &rates {
                out.push_str(&format!(" {r:.0}/s added p50 | {r:.0}/s added p99 |"));
            }
            out.push_str("\n| --- |");
            for _ in &rates {
                out.push_str(" ---: | ---: |");
            }
            out.push('\n');
            for s in self.summary.iter().skip(1) {
                out.push_str(&format!("| {} |", s.label));
                for r in &rates {
                    match s.open.iter().find(|o| o.rate_per_s == *r) {
                        Some(o) => out.push_str(&format!(
                            " {} ({}) | {} ({}) |",
                            added_cell(o.added_p50_us.as_ref()),
                            added_runs_cell(o.added_p50_us.as_ref()),
                            added_cell(o.added_p99_us.as_ref()),
                            added_runs_cell(o.added_p99_us.as_ref()),
                        )),
                        None => out.push_str(" not sustained | not sustained |"),
                    }
                }
                out.push('\n');
            }
        }
        out.push_str("\nPeak memory (`VmHWM` of each gateway's processes after the last run):\n\n");
        for r in &self.peak_rss {
            out.push_str(&format!(
                "- {} ({}): {:.1} MiB in {} process(es)\n",
                r.gateway,
                r.paths.join(", "),
                r.bytes as f64 / (1024.0 * 1024.0),
                r.processes
            ));
        }
        out.push_str("\nLoad averages (1, 5, 15 min) before and after each run:\n\n");
        for (i, r) in self.runs.iter().enumerate() {
            let [b1, b5, b15] = r.load_avg_before;
            let [a1, a5, a15] = r.load_avg_after;
            out.push_str(&format!(
                "- run {}: {b1:.2} {b5:.2} {b15:.2} -> {a1:.2} {a5:.2} {a15:.2}\n",
                i + 1
            ));
        }
        let failed = self.failed_requests();
        if !failed.is_empty() {
            out.push_str("\nFailed requests over every run (the figures above count only answered ones):\n\n");
            for (label, cell, errors) in failed {
                let list: Vec<String> = errors.iter().map(|(k, v)| format!("{v} {k}")).collect();
                out.push_str(&format!("- {label}, {cell}: {}\n", list.join(", ")));
            }
        }
        for s in &self.skipped {
            out.push_str(&format!(
                "\n**{} skipped**: {}\n",
                s.kind.as_str(),
                s.reason
            ));
        }
        out.push('\n');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Percentiles;

    fn pct(us: u64) -> Percentiles {
        Percentiles {
            count: 100,
            p50_us: us,
            p90_us: us,
            p99_us: 2 * us,
            p999_us: 2 * us,
            max_us: 2 * us,
            mean_us: us as f64,
        }
    }

    fn report(label: &str, concurrency: u32, rps: f64, us: u64, errors: u64) -> LoadReport {
        LoadReport {
            label: label.into(),
            mode: LoadMode::Closed { concurrency },
            stream: false,
            window_s: 1.0,
            requests: 100 + errors,
            ok: 100,
            errors: if errors > 0 {
                BTreeMap::from([("timeout".to_owned(), errors)])
            } else {
                BTreeMap::new()
            },
            throughput_rps: rps,
            chunks: 0,
            chunks_per_s: 0.0,
            total: Some(pct(us)),
            ttft: Some(pct(us / 2)),
            gap: Some(pct(10)),
        }
    }

    fn path_run(label: &str, us: u64, max_rps: f64) -> PathRun {
        PathRun {
            label: label.into(),
            single: report(label, 1, 1000.0, us, 0),
            single_stream: report(label, 1, 1000.0, us, 0),
            steps: Vec::new(),
            max_rps: Some(max_rps),
            max_rps_concurrency: Some(8),
            open: vec![LoadReport {
                mode: LoadMode::Open { rate_per_s: 1000.0 },
                ..report(label, 1, 1000.0, us, 0)
            }],
        }
    }

    #[test]
    fn figures_are_medians_of_the_runs() {
        assert_eq!(Figure::of(vec![3.0, 1.0, 2.0]).unwrap().median, 2.0);
        assert_eq!(Figure::of(vec![4.0, 1.0]).unwrap().median, 2.5);
        assert_eq!(Figure::of(vec![4.0, 1.0]).unwrap().runs, [4.0, 1.0]);
        assert!(Figure::of(Vec::new()).is_none());
    }

    #[test]
    fn the_rate_search_takes_the_best_step_under_the_bound() {
        let bound = Duration::from_millis(20);
        // p99 is twice the p50 given here.
        let steps = [
            report("x", 1, 1000.0, 1_000, 0),
            report("x", 2, 1800.0, 2_000, 0),
            report("x", 4, 2500.0, 9_000, 1),
            report("x", 8, 2600.0, 11_000, 0),
        ];
        let best = best_step(&steps, bound).unwrap();
        assert_eq!(best.mode, LoadMode::Closed { concurrency: 2 });
        assert!(!under_bound(&steps[2], bound), "a failed request");
        assert!(!under_bound(&steps[3], bound), "p99 22 ms");
        // The best step under the bound made 1,800/s: offered 1,000/s
        // (1,250 needed) and 1,440/s, not 1,500/s (1,875 needed).
        assert!(offered(&steps, bound, 1000.0));
        assert!(offered(&steps, bound, 1440.0));
        assert!(!offered(&steps, bound, 1500.0));
        assert!(!offered(&[], bound, 1.0), "no step, no rate");
    }

    #[test]
    fn added_figures_are_against_the_direct_path_of_the_same_run() {
        let run = |direct_us, via_us, rps| GatewaysRun {
            load_avg_before: [1.0, 2.0, 3.0],
            load_avg_after: [1.5, 2.0, 3.0],
            paths: vec![
                path_run(DIRECT, direct_us, 30_000.0),
                path_run("iop tunnel", via_us, rps),
            ],
        };
        let mut runs = vec![
            run(100, 600, 5_000.0),
            run(300, 700, 6_000.0),
            run(200, 1_200, 4_000.0),
        ];
        for r in &mut runs {
            r.paths[1].single_stream.errors = BTreeMap::from([("http_500".to_owned(), 7)]);
        }
        let s = summarize(&runs);
        assert_eq!(s.len(), 2);
        assert!(s[0].added_p50_us.is_none(), "the baseline adds nothing");
        assert_eq!(s[0].p50_us.as_ref().unwrap().median, 200.0);
        let added = s[1].added_p50_us.as_ref().unwrap();
        assert_eq!(added.runs, [500.0, 400.0, 1_000.0]);
        assert_eq!(added.median, 500.0);
        assert_eq!(s[1].added_p99_us.as_ref().unwrap().median, 1_000.0);
        assert_eq!(s[1].max_rps.as_ref().unwrap().median, 5_000.0);
        assert!(s[0].open.is_empty());
        assert_eq!(s[1].open.len(), 1);
        assert_eq!(s[1].open[0].rate_per_s, 1000.0);
        assert_eq!(s[1].open[0].added_p99_us.as_ref().unwrap().median, 1_000.0);
        let result = GatewaysResult {
            p99_bound_ms: 20.0,
            duration_s: 10.0,
            step_duration_s: 5.0,
            skipped: vec![SkippedPeer {
                kind: PeerKind::Portkey,
                reason: "not installed".into(),
            }],
            summary: s,
            runs,
            peak_rss: vec![PeakRss {
                gateway: "iop".into(),
                paths: vec!["iop tunnel".into()],
                processes: 2,
                bytes: 30 << 20,
            }],
        };
        let md = result.markdown();
        assert!(
            md.contains("| iop tunnel | 0.700 | 1.400 | +0.500 | +1.000 |"),
            "{md}"
        );
        assert!(md.contains("| 5000 | 30.0 |"), "{md}");
        assert!(
            md.contains("| iop tunnel | +0.500 (+0.500, +0.400, +1.000) | +1.000 ("),
            "{md}"
        );
        assert!(
            md.contains("| iop tunnel | +0.500, +0.400, +1.000 |"),
            "{md}"
        );
        assert!(
            md.contains("- run 1: 1.00 2.00 3.00 -> 1.50 2.00 3.00"),
            "{md}"
        );
        assert!(md.contains("**portkey skipped**: not installed"), "{md}");
        assert!(
            md.contains("- iop tunnel, one client, streamed: 21 http_500"),
            "{md}"
        );
        let json = serde_json::to_string(&result).unwrap();
        let back: GatewaysResult = serde_json::from_str(&json).unwrap();
        assert_eq!(back.summary, result.summary);
    }

    #[test]
    fn labels_name_the_runtime_and_the_baseline_only_when_set() {
        assert_eq!(runtime_suffix(None, None, false), "");
        assert_eq!(runtime_suffix(Some(1), None, false), " (1 thread)");
        assert_eq!(runtime_suffix(Some(4), None, false), " (4 workers)");
        assert_eq!(runtime_suffix(None, None, true), " (baseline)");
        assert_eq!(runtime_suffix(Some(1), None, true), " (1 thread, baseline)");
        let bbr = QuicVariant::parse("congestion=bbr").unwrap();
        assert_eq!(
            runtime_suffix(Some(1), bbr.as_ref(), true),
            " (1 thread, congestion=bbr, baseline)"
        );
    }

    #[test]
    fn quic_variants_are_tables_of_name_value_settings() {
        assert_eq!(QuicVariant::parse("default"), Ok(None));
        let v = QuicVariant::parse(
            "ack_eliciting_threshold=0+segmentation_offload=false+congestion=bbr",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            v.body,
            "ack_eliciting_threshold = 0\nsegmentation_offload = false\ncongestion = \"bbr\"\n"
        );
        assert!(QuicVariant::parse("congestion").is_err());
        assert!(QuicVariant::parse("a=\"x\"").is_err());
        assert!(QuicVariant::parse("a=1+").is_err());
    }
}
