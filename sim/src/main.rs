//! `iop-sim`: run, swarm, check determinism, replay.
//!
//! A failing run prints the one command that reproduces it and exits with
//! status 1.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant as WallInstant;

use clap::{Parser, Subcommand};
use iop_sim::trace::{MachineKind, TraceReader, replay};
use iop_sim::{
    Bug, Capture, CoreBugs, DEFAULT_STEPS, RunOptions, SwarmOptions, check_determinism, run, swarm,
};

/// The deterministic simulator of iop.
#[derive(Debug, Parser)]
#[command(name = "iop-sim", version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run one seed and check every invariant after every step.
    Run {
        /// The seed.
        seed: u64,
        /// Steps of the fault and quiet phases (the drain comes on top).
        #[arg(long, default_value_t = DEFAULT_STEPS)]
        steps: u64,
        /// Write the trace of one core machine to this file.
        #[arg(long, value_name = "FILE")]
        record_trace: Option<PathBuf>,
        /// Which machine to record: edge-dispatch, edge-link, node-link,
        /// edge-request, node-run, edge-custody, edge-tenants.
        #[arg(long, default_value = "edge-dispatch")]
        machine: String,
        /// Which instance of that machine (0 = the first one created).
        #[arg(long, default_value_t = 0)]
        instance: u64,
        /// Plant a driver bug (to see the invariants bite).
        #[arg(long, value_name = "BUG")]
        bug: Vec<String>,
        /// Plant a bug in the core machines (needs `--features planted-bugs`).
        #[arg(long, value_name = "BUG")]
        core_bug: Vec<String>,
        /// Treat known core issues as violations.
        #[arg(long)]
        strict: bool,
        /// No durable requests, whatever the seed says (the world as it was
        /// before durable responses).
        #[arg(long)]
        ephemeral_only: bool,
        /// Let the journal store fail syncs (I/O errors) while faults are on.
        #[arg(long)]
        store_faults: bool,
        /// No tenants, whatever the seed says (the world as it was before
        /// tenants' limits).
        #[arg(long)]
        no_tenants: bool,
        /// Edges sharing the store, every node connected to each (1-4).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4))]
        edges: u64,
    },
    /// Run many seeds; report the failing ones.
    Swarm {
        /// How many seeds.
        #[arg(long)]
        seeds: u64,
        /// The first seed.
        #[arg(long, default_value_t = 0)]
        start: u64,
        /// Steps per seed.
        #[arg(long, default_value_t = DEFAULT_STEPS)]
        steps: u64,
        /// Plant a driver bug.
        #[arg(long, value_name = "BUG")]
        bug: Vec<String>,
        /// Plant a bug in the core machines (needs `--features planted-bugs`).
        #[arg(long, value_name = "BUG")]
        core_bug: Vec<String>,
        /// Treat known core issues as violations.
        #[arg(long)]
        strict: bool,
        /// No durable requests, whatever the seeds say.
        #[arg(long)]
        ephemeral_only: bool,
        /// Let the journal store fail syncs (I/O errors) while faults are on.
        #[arg(long)]
        store_faults: bool,
        /// No tenants, whatever the seed says (the world as it was before
        /// tenants' limits).
        #[arg(long)]
        no_tenants: bool,
        /// Edges per world (1-4); without it each seed runs with its own
        /// number, 1 to 4.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4))]
        edges: Option<u64>,
        /// Worker threads (default: every core); the report is the same.
        #[arg(long)]
        threads: Option<usize>,
        /// Run the seeds in chunks of this many and print a progress line
        /// after each (a long swarm stopped early still says how far it
        /// got); memory stays bounded by one chunk.
        #[arg(long, default_value_t = DEFAULT_CHUNK_SEEDS)]
        chunk: u64,
    },
    /// Run a seed twice and compare the trace hashes.
    CheckDeterminism {
        /// The seed.
        seed: u64,
        /// Steps.
        #[arg(long, default_value_t = DEFAULT_STEPS)]
        steps: u64,
    },
    /// Feed a recorded trace through a fresh machine and compare outputs.
    Replay {
        /// The trace file.
        trace: PathBuf,
    },
}

/// Seeds per chunk of `iop-sim swarm` unless `--chunk` says otherwise.
const DEFAULT_CHUNK_SEEDS: u64 = 50_000;

/// Faults a swarm injected (the sum of its fault counters).
fn faults_injected(t: &iop_sim::Stats) -> u64 {
    t.node_crashes
        + t.edge_restarts
        + t.partitions
        + t.conns_killed
        + t.messages_lost
        + t.provider_freezes
        + t.node_freezes
        + t.provider_5xx
        + t.heartbeat_timeouts
}

fn bugs(names: &[String]) -> Result<BTreeSet<Bug>, String> {
    names
        .iter()
        .map(|n| {
            Bug::parse(n).ok_or_else(|| {
                let all: Vec<&str> = Bug::ALL.iter().map(|b| b.as_str()).collect();
                format!("unknown bug {n:?}; known: {}", all.join(", "))
            })
        })
        .collect()
}

#[cfg(feature = "planted-bugs")]
fn core_bugs(names: &[String]) -> Result<CoreBugs, String> {
    use iop_core::planted::PlantedBug;
    names.iter().try_fold(CoreBugs::none(), |bugs, n| {
        let bug = PlantedBug::parse(n).ok_or_else(|| {
            let all: Vec<&str> = PlantedBug::ALL.iter().map(|b| b.as_str()).collect();
            format!("unknown core bug {n:?}; known: {}", all.join(", "))
        })?;
        Ok(bugs.plant(bug))
    })
}

#[cfg(not(feature = "planted-bugs"))]
fn core_bugs(names: &[String]) -> Result<CoreBugs, String> {
    if names.is_empty() {
        Ok(CoreBugs::none())
    } else {
        Err("this iop-sim has no planted core bugs; build it with `--features planted-bugs`".into())
    }
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(message) => {
            eprintln!("iop-sim: {message}");
            ExitCode::from(2)
        }
    }
}

fn real_main() -> Result<ExitCode, String> {
    match Cli::parse().command {
        Cmd::Run {
            seed,
            steps,
            record_trace,
            machine,
            instance,
            bug,
            core_bug,
            strict,
            ephemeral_only,
            store_faults,
            no_tenants,
            edges,
        } => {
            let bugs = bugs(&bug)?;
            let core_bugs = core_bugs(&core_bug)?;
            let capture = match record_trace {
                None => None,
                Some(path) => {
                    let machine = MachineKind::parse(&machine)
                        .ok_or_else(|| format!("unknown machine {machine:?}"))?;
                    let file = File::create(&path)
                        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
                    Some(Capture {
                        machine,
                        instance,
                        writer: Box::new(BufWriter::new(file)),
                    })
                }
            };
            let started = WallInstant::now();
            let report = run(
                seed,
                RunOptions {
                    steps,
                    hash: true,
                    capture,
                    bugs,
                    core_bugs,
                    strict,
                    ephemeral_only,
                    store_faults,
                    no_tenants,
                    edges: edges as usize,
                },
            );
            let secs = started.elapsed().as_secs_f64();
            let s = &report.stats;
            println!(
                "seed {seed}: {} steps ({} drain), {:.1}s virtual, {} requests ({} finished, {} failed, {} left, {} lost with the edge), {} stalls, {} readmissions, {} fences, {} heartbeat timeouts, {} node crashes, {} edge restarts, {} partitions, {} connections killed",
                s.steps,
                s.drain_steps,
                s.virtual_us as f64 / 1e6,
                s.requests,
                s.finished,
                s.failed,
                s.client_left,
                s.edge_lost,
                s.stalls,
                s.readmissions,
                s.fences,
                s.heartbeat_timeouts,
                s.node_crashes,
                s.edge_restarts,
                s.partitions,
                s.conns_killed,
            );
            if s.node_freezes > 0 || s.provider_5xx > 0 {
                println!(
                    "failover: {} node freezes ({} until the faults stopped, {} found lost by the Edge's heartbeat), {} provider 5xx answers ({} outages detected from them)",
                    s.node_freezes,
                    s.node_freezes_forever,
                    s.freeze_losses,
                    s.provider_5xx,
                    s.outages_5xx,
                );
            }
            if s.durable_requests > 0 || s.journal_writes > 0 {
                println!(
                    "durable: {} requests, {} journal writes in {} syncs ({} batched), {} takeovers ({} retried, {} given up), {} orphans continued, {} continued attempts, {} lost and {} unacknowledged at crashes, {} end crash points ({} ends left without a terminal, {} ended as journaled by a takeover), {} zombies ({} accepted, {} fenced), {} left, {} read on after their request was fenced, {} cancelled, {} resumes ({} events read), {} sent again with their key ({} answered with the existing response, {} afresh), {} left open by their request for the custody to end ({} refused while such records waited for room), {} store outages",
                    s.durable_requests,
                    s.journal_writes,
                    s.journal_syncs,
                    s.journal_batched,
                    s.takeovers,
                    s.takeover_retries,
                    s.takeovers_given_up,
                    s.takeover_continued,
                    s.continued_attempts,
                    s.journal_lost,
                    s.journal_unacked,
                    s.end_crash_points,
                    s.journaled_ends_open,
                    s.journaled_ends_taken,
                    s.zombies,
                    s.zombies_accepted,
                    s.zombies_fenced,
                    s.durable_left,
                    s.records_taken,
                    s.durable_cancels,
                    s.resumes,
                    s.resumed_events,
                    s.idempotent_retries,
                    s.idempotent_existing,
                    s.idempotent_fresh,
                    s.records_left_open,
                    s.durable_backlog_refused,
                    s.journal_outages,
                );
            }
            if s.tenant_admitted + s.tenant_refused > 0 {
                println!(
                    "tenants: {} admitted, {} refused, {} further attempts reserved ({} refused, {} asked again), {} settled, {} takeovers held ({} adoptions), {} output tokens charged by estimate, {} claims, {} store failures, {} store outages, {} graceful stops ({} given back)",
                    s.tenant_admitted,
                    s.tenant_refused,
                    s.tenant_attempts_reserved,
                    s.tenant_attempts_refused,
                    s.tenant_attempts_waited,
                    s.tenant_settled,
                    s.tenant_adoptions_held + s.tenant_continuations_held,
                    s.tenant_adoptions_held,
                    s.tenant_unmetered_tokens,
                    s.tenant_claims,
                    s.tenant_store_failures,
                    s.tenant_store_outages,
                    s.tenant_graceful_stops,
                    s.tenant_given_back,
                );
            }
            if s.runs_parked > 0 || s.parked_reported > 0 {
                println!(
                    "parked runs: {} parked, {} reported, {} waits ended as their node came back without them, {} adoptions sent ({} accepted, {} refused), {} taken over by adoption, {} expired, {} died with their node, {} offers let go, {} provider reads put off",
                    s.runs_parked,
                    s.parked_reported,
                    s.parks_ended_not_kept,
                    s.adoptions_sent,
                    s.node_adoptions,
                    s.adoptions_refused,
                    s.takeover_adoptions,
                    s.park_expired,
                    s.durable_runs_crashed,
                    s.offers_released,
                    s.park_paused,
                );
            }
            if let Some((hash, lines)) = &report.trace_hash {
                println!("trace hash {hash} over {lines} lines");
            }
            println!(
                "{:.0} steps/s wall",
                s.steps as f64 / secs.max(f64::EPSILON)
            );
            for f in &report.findings {
                println!("finding (known core issue): {f}");
            }
            if !report.findings.is_empty() && report.violation.is_none() {
                println!(
                    "reproduce as a violation: {}",
                    report.strict_repro_command()
                );
            }
            match &report.violation {
                None => Ok(ExitCode::SUCCESS),
                Some(v) => {
                    println!("FAILED: {v}");
                    println!("reproduce: {}", report.repro_command());
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Cmd::Swarm {
            seeds,
            start,
            steps,
            bug,
            core_bug,
            strict,
            ephemeral_only,
            store_faults,
            no_tenants,
            edges,
            threads,
            chunk,
        } => {
            let threads = threads.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            });
            let chunk = chunk.max(1);
            let options = SwarmOptions {
                bugs: bugs(&bug)?,
                core_bugs: core_bugs(&core_bug)?,
                strict,
                threads,
                ephemeral_only,
                store_faults,
                no_tenants,
                edges: edges.map(|e| e as usize),
                ..SwarmOptions::new(start, seeds, steps)
            };
            let started = WallInstant::now();
            let mut totals = iop_sim::Stats::default();
            let mut failures = Vec::new();
            let mut with_findings = Vec::new();
            let mut done = 0u64;
            while done < seeds {
                let count = chunk.min(seeds - done);
                let report = swarm(&SwarmOptions {
                    start: start.saturating_add(done),
                    count,
                    ..options.clone()
                });
                done += count;
                totals.add(&report.totals);
                for r in &report.failures {
                    if let Some(v) = &r.violation {
                        println!("seed {}: {v}", r.seed);
                        println!("  reproduce: {}", r.repro_command());
                    }
                }
                failures.extend(report.failures);
                with_findings.extend(report.with_findings.into_iter().take(10));
                if seeds > chunk {
                    println!(
                        "progress: {done} of {seeds} seeds from {start}, {} failed, {} faults injected, {:.0}s",
                        failures.len(),
                        faults_injected(&totals),
                        started.elapsed().as_secs_f64()
                    );
                }
            }
            let secs = started.elapsed().as_secs_f64();
            println!(
                "{seeds} seeds from {start} x {steps} steps on {threads} threads in {secs:.1}s ({:.0} steps/s): {} failed, {} faults injected",
                totals.steps as f64 / secs.max(f64::EPSILON),
                failures.len(),
                faults_injected(&totals)
            );
            println!(
                "coverage: {}",
                serde_json::to_string(&totals).unwrap_or_default()
            );
            if !with_findings.is_empty() {
                println!("seeds passed with findings (known core issues):");
                for r in with_findings.iter().take(10) {
                    if let Some(f) = r.findings.first() {
                        println!("seed {}: {f}", r.seed);
                        println!("  reproduce as a violation: {}", r.strict_repro_command());
                    }
                }
            }
            Ok(if failures.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::CheckDeterminism { seed, steps } => {
            let report = check_determinism(seed, steps);
            println!("run 1: {} over {} lines", report.first.0, report.first.1);
            println!("run 2: {} over {} lines", report.second.0, report.second.1);
            if report.is_deterministic() {
                println!("deterministic");
                Ok(ExitCode::SUCCESS)
            } else {
                println!(
                    "NOT deterministic; reproduce: iop-sim check-determinism {seed} --steps {steps}"
                );
                Ok(ExitCode::FAILURE)
            }
        }
        Cmd::Replay { trace } => {
            let file =
                File::open(&trace).map_err(|e| format!("cannot open {}: {e}", trace.display()))?;
            let reader = TraceReader::new(BufReader::new(file)).map_err(|e| e.to_string())?;
            match replay(reader) {
                Ok(report) => {
                    println!(
                        "replayed {} trace: {} inputs, {} outputs match",
                        report.machine.as_str(),
                        report.inputs,
                        report.checked
                    );
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    println!("replay failed: {e}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
    }
}
