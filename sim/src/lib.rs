//! # iop-sim: the deterministic simulator of iop
//!
//! One Edge, its Nodes, their providers and clients, all running the real
//! `iop-core` state machines, driven by **one seeded RNG** over **virtual
//! time** (after quinn-proto's test `Pair`, TigerBeetle's VOPR and str0m's
//! `netem`). Each seed decides its own fault mix (swarm testing), runs, and
//! has every invariant checked after every step. The same seed always
//! produces the same run; a failure prints the one command that reproduces
//! it.
//!
//! * [`config`]: the world of a seed, and the liveness bounds.
//! * [`net`]: the network model (latency, jitter, per-stream order, loss
//!   that kills connections, heartbeat loss, partitions).
//! * [`provider`]: simulated provider calls and probes.
//! * [`world`]: the world, the Edge and Node drivers in miniature, faults.
//! * [`journal_store`]: the simulated journal store of durable responses
//!   (group commit, crash points), deciding every write by the core's
//!   journal rules.
//! * [`tenant_store`]: the simulated shared store of tenants' counters
//!   (read, compare-and-set, latency, failures), every claim decided by
//!   core's `check_claim`.
//! * [`invariants`]: what must hold after every step.
//! * [`core_bugs`]: bugs planted in the core machines (to prove the
//!   invariants bite).
//! * [`fuzzing`]: fuzz harness bodies for the core dispatcher and watchdog
//!   (`fuzz/`), replayed from the committed corpus by `cargo test`.
//! * [`trace`]: the versioned JSON-lines trace format of one core machine,
//!   recording wrappers and replay.
//!
//! See `docs/simulation.md` for how to run, reproduce, record and replay.

#![warn(missing_docs)]

pub mod config;
pub mod core_bugs;
pub mod fuzzing;
pub mod invariants;
pub mod journal_store;
pub mod net;
pub mod provider;
mod record;
pub mod tenant_store;
pub use iop_trace as trace;
pub mod world;

pub use core_bugs::CoreBugs;
pub use record::Capture;
pub use world::{Bug, MAX_EDGES, RunOptions, RunReport, Stats, run};

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

/// Steps per seed when none is given.
pub const DEFAULT_STEPS: u64 = 5_000;

/// What a swarm found.
#[derive(Debug, Clone, Default)]
pub struct SwarmReport {
    /// Every failing run.
    pub failures: Vec<RunReport>,
    /// Every passing run with findings (known core issues).
    pub with_findings: Vec<RunReport>,
    /// Counters summed over every run (coverage).
    pub totals: Stats,
}

/// How to run a swarm of seeds.
#[derive(Debug, Clone)]
pub struct SwarmOptions {
    /// The first seed.
    pub start: u64,
    /// How many seeds.
    pub count: u64,
    /// Steps per seed.
    pub steps: u64,
    /// Planted driver bugs.
    pub bugs: BTreeSet<Bug>,
    /// Planted core bugs.
    pub core_bugs: CoreBugs,
    /// Treat known core issues as violations.
    pub strict: bool,
    /// Worker threads; the report is the same for any number.
    pub threads: usize,
    /// No durable requests, whatever the seeds say.
    pub ephemeral_only: bool,
    /// Let the journal store fail syncs.
    pub store_faults: bool,
    /// No tenants, whatever the seeds say.
    pub no_tenants: bool,
    /// Edges per world; `None`: each seed's own, 1 to [`MAX_EDGES`]
    /// ([`edges_of_seed`]).
    pub edges: Option<usize>,
}

/// The Edges a swarm seed runs with when the swarm does not say: 1 to
/// [`MAX_EDGES`], from a hash of the seed (not its RNG, so each seed's
/// world is drawn as it is with one Edge).
pub fn edges_of_seed(seed: u64) -> usize {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    1 + (z % MAX_EDGES as u64) as usize
}

impl SwarmOptions {
    /// `count` seeds from `start`, `steps` steps each, nothing planted, one
    /// thread.
    pub fn new(start: u64, count: u64, steps: u64) -> Self {
        Self {
            start,
            count,
            steps,
            bugs: BTreeSet::new(),
            core_bugs: CoreBugs::none(),
            strict: false,
            threads: 1,
            ephemeral_only: false,
            store_faults: false,
            no_tenants: false,
            edges: Some(1),
        }
    }

    fn run_options(&self, seed: u64) -> RunOptions {
        RunOptions {
            edges: self.edges.unwrap_or_else(|| edges_of_seed(seed)),
            steps: self.steps,
            bugs: self.bugs.clone(),
            core_bugs: self.core_bugs.clone(),
            strict: self.strict,
            ephemeral_only: self.ephemeral_only,
            store_faults: self.store_faults,
            no_tenants: self.no_tenants,
            ..RunOptions::default()
        }
    }
}

/// Run every seed of `options` (on `options.threads` threads, each seed on
/// its own world) and report them in seed order.
pub fn swarm(options: &SwarmOptions) -> SwarmReport {
    let end = options.start.saturating_add(options.count);
    let next = AtomicU64::new(options.start);
    let worker = || {
        let mut done = Vec::new();
        loop {
            let seed = next.fetch_add(1, Ordering::Relaxed);
            if seed >= end {
                return done;
            }
            done.push(run(seed, options.run_options(seed)));
        }
    };
    let mut reports: Vec<RunReport> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..options.threads.max(1))
            .map(|_| scope.spawn(worker))
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    reports.sort_by_key(|r| r.seed);
    let mut report = SwarmReport::default();
    for r in reports {
        report.totals.add(&r.stats);
        if r.violation.is_some() {
            report.failures.push(r);
        } else if !r.findings.is_empty() {
            report.with_findings.push(r);
        }
    }
    report
}

/// Run the seeds of `options` in order, one at a time, until one fails;
/// return that run.
pub fn first_failure(options: &SwarmOptions) -> Option<RunReport> {
    (options.start..options.start.saturating_add(options.count))
        .map(|seed| run(seed, options.run_options(seed)))
        .find(|r| r.violation.is_some())
}

/// The outcome of running a seed twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeterminismReport {
    /// The first run's hash and lines.
    pub first: (String, u64),
    /// The second run's hash and lines.
    pub second: (String, u64),
}

impl DeterminismReport {
    /// Whether both runs hashed the same.
    pub fn is_deterministic(&self) -> bool {
        self.first == self.second
    }
}

/// Run `seed` twice with hashing on and compare the trace hashes (SHA-256
/// over a canonical JSON serialization of every core input, return value
/// and output, and every client-visible delivery).
pub fn check_determinism(seed: u64, steps: u64) -> DeterminismReport {
    let once = || {
        run(
            seed,
            RunOptions {
                steps,
                hash: true,
                ..RunOptions::default()
            },
        )
        .trace_hash
        .unwrap_or_default()
    };
    DeterminismReport {
        first: once(),
        second: once(),
    }
}
