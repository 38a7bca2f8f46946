//! Writes the seed corpus of the core fuzz targets:
//! `cargo run -p iop-sim --example core_fuzz_seeds -- fuzz/corpus`.
//!
//! A few hand-written scenarios (in the byte format `iop_sim::fuzzing`
//! decodes) plus a few inputs from a fixed generator; `cargo test -p
//! iop-sim` replays whatever is committed (`tests/fuzz_corpus.rs`).

use std::path::PathBuf;

/// Dispatcher scenarios. Header: nodes-1, providers per node-1, one
/// capacity byte per provider, health refresh, queue capacity, queue
/// timeout, generation floor. Then ops (`byte % 12`): 0 connect, 1 ready,
/// 2 disconnect, 3/4 request, 5 pre-send, 6/7 terminal, 8 cancel,
/// 9 CAPABILITIES, 10 probe answer, 11 advance time.
const DISPATCH: [(&str, &[u8]); 4] = [
    (
        // One node, one provider of capacity 2: lease, send, a stall with
        // fresh `unavailable` evidence lowers it, CAPABILITIES recovers it.
        "seed_stall_lowers_then_recovers",
        &[
            0, 0, 1, 0, 2, 3, 0, // header
            0, 0, // connect a
            1, 0, 0, // ready a, current generation
            3, 0, 0, 0, // request, whole pool
            5, 0, // pre-send the latest lease
            6, 0, 0, 2, 1, 0, // terminal: own reception, stall, unavailable, next seq
            3, 0, 0, 0, // request again (the provider is lowered: queued)
            9, 0, 0, 0, 0, 0, // CAPABILITIES: available, not ambiguous, next seq
            11, 10, // advance 200 ms
            2, 0, 0, // disconnect a
        ],
    ),
    (
        // Two nodes: a reconnect fences the old generation; its late
        // terminal and CAPABILITIES answer are ignored and counted; a
        // pre-send of the fenced lease is not answered `Send`.
        "seed_reconnect_fences_the_old_generation",
        &[
            1, 0, 1, 1, 0, 2, 3, 0, // header
            0, 0, 1, 0, 0, // connect a, ready a
            0, 1, 1, 1, 0, // connect b, ready b
            3, 1, 0, 0, 0, // request for p0 only
            0, 0, // a reconnects: generation 1 is fenced
            5, 0, // pre-send of the fenced lease
            6, 0, 4, 2, 2, 0, 0, // its terminal on the old generation
            9, 0, 2, 0, 0, 0, // CAPABILITIES of the old generation
            1, 0, 0, // ready on the new generation
            3, 0, 0, 0, 11, 50, // request, advance 1 s
        ],
    ),
    (
        // Avoid hints: a stalled provider is avoided while an alternate is
        // eligible, and chosen with the fallback flag when none is.
        "seed_avoid_and_fallback",
        &[
            0, 1, 0, 0, 0, 4, 5, 0, // header: one node, two providers
            0, 0, 1, 0, 0, // connect, ready
            3, 0, 1, 0, 1, // request avoiding p0, fallback allowed
            3, 0, 1, 1, 0, // request avoiding p1, no fallback
            3, 0, 1, 0, 1, // again: both busy, queued
            7, 0, 0, 2, 0, 0, // stall terminal with `available` evidence
            8, 1, // cancel request 2
            11, 30, 11, 30, // advance past the queue timeout
        ],
    ),
    (
        // Probes: the health tracker asks for one, it is answered from the
        // ready generation, then with a transport failure.
        "seed_health_probes",
        &[
            2, 1, 2, 0, 1, 2, 0, 3, 1, 1, 1, 0, // header: three nodes, two providers each
            0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 2, 1, 2, 0, // connect and ready all
            11, 40, // advance 800 ms: probes fall due
            10, 0, 1, 0, 1, 0, 0, // answer a probe with a report
            10, 0, 0, // answer another with a transport failure
            11, 200, 11, 200, // advance 8 s
        ],
    ),
];

/// Watchdog scenarios. Header: close grace (x50 ms), probe bound (x50 ms),
/// max runs-1, bound sequence. Then ops (`byte % 10`): 0/1 start,
/// 2/3 progress, 4 neutral output, 5 provider return, 6 probe verdict,
/// 7 cancel, 8 take a sequence value (odd) or disconnect (even),
/// 9 advance time (x10 ms).
const WATCHDOG: [(&str, &[u8]); 4] = [
    (
        // A stall: claim, the provider returns within the grace, the probe
        // answers healthy, one retryable terminal; late output is fenced.
        "seed_stall_within_grace",
        &[
            4, 6, 3, 1, // grace 200 ms, probe bound 300 ms, 4 runs, bound
            0, 0, 4, 0, // start run 1: normalized, stall 500 ms, no deadline
            2, 0, 0, // progress
            9, 60, // advance 600 ms: the stall is claimed
            5, 0, 1, // the provider returns (within the grace)
            6, 0, 0, // probe: healthy
            9, 50, // advance: the terminal is out
            2, 128, 0, // late progress of run 1: fenced
            8, 1, // a CAPABILITIES answer takes the next sequence value
        ],
    ),
    (
        // A hard deadline coincides with the stall and wins (R-WD-7).
        "seed_deadline_wins",
        &[
            2, 2, 1, 1, // grace 100 ms, probe bound 100 ms
            0, 0, 4, 11, // start: stall 500 ms, deadline 500 ms
            9, 50, 9, 50, // advance 1 s
        ],
    ),
    (
        // Runs and tunnels, a client cancel, then a disconnect ends every
        // run once (R-DISC-1).
        "seed_disconnect_ends_every_run",
        &[
            10, 4, 7, 0, // grace 500 ms, probe 200 ms, 8 runs, unbound
            0, 1, 9, 0, // start a tunnel
            1, 0, 2, 0, // start a run
            0, 1, 19, 0, // another tunnel
            3, 1, 3, // tunnel body
            7, 0, 0, // client cancel of a live run
            9, 35, // advance 350 ms
            8, 0, // disconnect
        ],
    ),
    (
        // Probe timeout: the verdict is unknown and the terminal comes at
        // claim + max(grace, probe bound), never their sum.
        "seed_probe_timeout",
        &[
            8, 12, 0, 1, // grace 400 ms, probe bound 600 ms, 1 run
            0, 0, 0, 0, // start: stall 100 ms
            0, 0, 0, 0, // a second start is refused at the limit
            9, 20, 9, 20, 9, 40, // advance
            6, 0, 1, // a verdict after the bound is ignored
        ],
    ),
];

/// Bytes from a fixed generator.
fn generated(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn main() -> std::io::Result<()> {
    let root = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus".into()),
    );
    for (target, scenarios) in [("core_dispatch", &DISPATCH), ("core_watchdog", &WATCHDOG)] {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in scenarios.iter() {
            std::fs::write(dir.join(name), bytes)?;
        }
        for seed in 0..4 {
            std::fs::write(
                dir.join(format!("seed_generated_{seed}")),
                generated(seed, 400),
            )?;
        }
        println!("wrote {}", dir.display());
    }
    Ok(())
}
