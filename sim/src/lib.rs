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
//! * [`invariants`]: what must hold after every step.
//! * [`trace`]: the versioned JSON-lines trace format of one core machine,
//!   recording wrappers and replay.
//!
//! See `docs/simulation.md` for how to run, reproduce, record and replay.

#![warn(missing_docs)]

pub mod config;
pub mod invariants;
pub mod net;
pub mod provider;
mod record;
pub use iop_trace as trace;
pub mod world;

pub use record::Capture;
pub use world::{Bug, RunOptions, RunReport, Stats, run};

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

/// Run `count` seeds from `start` with `steps` steps each.
pub fn swarm(
    start: u64,
    count: u64,
    steps: u64,
    bugs: &std::collections::BTreeSet<Bug>,
    strict: bool,
) -> SwarmReport {
    let mut report = SwarmReport::default();
    for seed in start..start.saturating_add(count) {
        let r = run(
            seed,
            RunOptions {
                steps,
                bugs: bugs.clone(),
                strict,
                ..RunOptions::default()
            },
        );
        report.totals.add(&r.stats);
        if r.violation.is_some() {
            report.failures.push(r);
        } else if !r.findings.is_empty() {
            report.with_findings.push(r);
        }
    }
    report
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
