//! What one simulated world looks like, all of it derived from the seed.
//!
//! Swarm testing (after TigerBeetle's VOPR): every seed first decides *which*
//! faults are enabled and *how likely* each one is, then the world is built
//! and run with that profile. Many seeds therefore explore many different
//! mixes (a seed with only partitions, one with only provider stalls, one
//! with everything) instead of one average mix that hides rare interactions.
//!
//! Probabilities are integers in parts per million (`*_ppm`), drawn with
//! [`Rng::chance`]; durations carry their unit last (`*_us`, `*_ms`).

use std::time::Duration;

use iop_core::rng::{RandomSource, SplitMix64};

/// One million: the denominator of every `*_ppm` probability.
pub const PPM: u32 = 1_000_000;

/// The simulator's only source of randomness: one seeded [`SplitMix64`].
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// A uniform value in `lo..=hi` (`lo` if `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.0.below_inclusive(hi - lo)
    }

    /// True with probability `ppm / 1_000_000`.
    pub fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.0.below_inclusive(u64::from(PPM) - 1) < u64::from(ppm)
    }

    /// A uniform index in `0..n` (`0` if `n == 0`).
    pub fn index(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        usize::try_from(self.0.below_inclusive(n as u64 - 1)).unwrap_or(0)
    }

    /// A duration uniform in `lo_ms..=hi_ms` milliseconds, at microsecond
    /// resolution.
    pub fn millis(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_micros(self.range(lo_ms * 1000, hi_ms * 1000))
    }

    /// A probability: with `enabled_ppm` the fault is switched on and gets a
    /// probability uniform in `lo_ppm..=hi_ppm`; otherwise zero.
    fn swarm(&mut self, enabled_ppm: u32, lo_ppm: u32, hi_ppm: u32) -> u32 {
        if self.chance(enabled_ppm) {
            u32::try_from(self.range(u64::from(lo_ppm), u64::from(hi_ppm))).unwrap_or(hi_ppm)
        } else {
            0
        }
    }
}

impl RandomSource for Rng {
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
}

/// Faults that act on whole connections and processes (per fault tick).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultProfile {
    /// Per message: the connection dies (loss that kills it).
    pub conn_kill_ppm: u32,
    /// Per heartbeat message (ping or pong): it is lost.
    pub heartbeat_loss_ppm: u32,
    /// Per tick and node: a partition starts.
    pub partition_ppm: u32,
    /// Of partitions, the share that is one-way.
    pub partition_one_way_ppm: u32,
    /// Longest partition.
    pub partition_max: Duration,
    /// Per tick and node: the node process crashes.
    pub node_crash_ppm: u32,
    /// Longest time a crashed node stays down.
    pub node_down_max: Duration,
    /// Per tick: the Edge process restarts.
    pub edge_restart_ppm: u32,
    /// Longest time the Edge stays down.
    pub edge_down_max: Duration,
    /// Per request: the client cancels early (before or while queued).
    pub client_cancel_ppm: u32,
    /// Per request: the client disconnects mid-stream.
    pub client_disconnect_ppm: u32,
    /// Of connection ends, the share the peer is told about at once (else
    /// it finds out through its heartbeat).
    pub close_notice_ppm: u32,
    /// Per message: a lost packet is retransmitted and the message (and
    /// its stream behind it) arrives late, so streams overtake each other.
    pub retransmit_ppm: u32,
    /// The longest retransmission delay.
    pub retransmit_max: Duration,
    /// Per tick and provider: the provider freezes (every call of it stops
    /// emitting at once and its probes time out: correlated stalls).
    pub provider_freeze_ppm: u32,
    /// Longest freeze.
    pub provider_freeze_max: Duration,
    /// Per tick and node: the node process freezes (silent node loss, as a
    /// `SIGSTOP` or a power cut would: it sends nothing, acknowledges
    /// nothing, its timers and its provider calls stop; no close notice
    /// reaches the Edge, which finds out only through its loss detection).
    pub node_freeze_ppm: u32,
    /// Of node freezes, the share that lasts until the faults stop (the
    /// others end after at most `node_freeze_max` and the process goes on
    /// where it stopped).
    pub node_freeze_forever_ppm: u32,
    /// Longest bounded node freeze.
    pub node_freeze_max: Duration,
}

/// Provider behaviours drawn per attempt while faults are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderProfile {
    /// Prefill longer than the stall timeout.
    pub slow_prefill_ppm: u32,
    /// Stops emitting after some tokens (a mid-stream stall).
    pub stall_ppm: u32,
    /// Accepts the request and never emits anything.
    pub hang_ppm: u32,
    /// Returns a provider error (reported by the provider in its stream,
    /// after some tokens or none).
    pub error_ppm: u32,
    /// Answers HTTP 5xx before any content: the call fails at once, without
    /// a `Started` (what `iop-node`'s HTTP adapters report for an error
    /// status: `provider_error` with the status and `http_5xx` health).
    pub http_5xx_ppm: u32,
    /// Closes the provider connection abruptly.
    pub abrupt_ppm: u32,
    /// After a cancel, the call returns within the close grace (else after
    /// it, or never).
    pub return_within_grace_ppm: u32,
    /// Of calls that do not return within the grace, the share that never
    /// returns.
    pub never_return_ppm: u32,
    /// Probe answers: healthy share.
    pub probe_ok_ppm: u32,
    /// Probe answers: unhealthy share (of the rest).
    pub probe_unhealthy_ppm: u32,
    /// Probe answers: probe error share (of the rest; the remainder times
    /// out).
    pub probe_error_ppm: u32,
}

/// Durable responses (SPEC §6): how many requests are durable, how the
/// simulated journal store behaves, what their clients do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalProfile {
    /// Of client requests, the share that is durable (0: the world has no
    /// journal traffic and runs exactly as before durable responses).
    pub durable_ppm: u32,
    /// Shortest sync of the store.
    pub sync_min: Duration,
    /// Longest sync of the store.
    pub sync_max: Duration,
    /// Longest time an answer of the store takes back to its writer.
    pub ack_max: Duration,
    /// Of durable clients that went away (left, or lost their Edge), the
    /// share that resumes (`starting_after` the last event it saw).
    pub resume_ppm: u32,
    /// Longest time before a client resumes.
    pub resume_delay_max: Duration,
    /// At an Edge crash, the share of running syncs that completed just
    /// before it (durable but unacknowledged).
    pub sync_survives_ppm: u32,
    /// Of the writes a crash lost, the share that still reaches the store
    /// late as a zombie (a dead owner's write, with its old epoch).
    pub zombie_ppm: u32,
    /// Of zombies, the share that arrives after the next Edge start (the
    /// rest while the Edge is down).
    pub zombie_late_ppm: u32,
    /// Longest time after the next Edge start a late zombie arrives.
    pub zombie_late_max: Duration,
    /// Per sync while faults are on: the Edge process dies at this crash
    /// point of the store, before the sync completed or after it, before
    /// its answers went out (half each). Only in worlds whose Edge restarts.
    pub crash_point_ppm: u32,
    /// Per sync that makes a record's end durable (its last journal event:
    /// a run's `Completed`) while faults are on: the Edge process dies
    /// before that record's terminal is written (R-TAKE-1, R-JRN-3): after
    /// the sync, before its answers went out, or once its request wrote
    /// the terminal, before that write became durable (half each). Only in
    /// worlds whose Edge restarts.
    pub end_crash_ppm: u32,
    /// Per sync while faults are on, with store faults switched on
    /// (`--store-faults`): the sync fails (an I/O error); none of its
    /// writes is applied and each is answered `Store(..)`.
    pub sync_failure_ppm: u32,
    /// How long a node keeps a durable run going without its connection
    /// (R-PARK-1); zero: durable runs do not park (the request's
    /// `park_grace_ms` is 0 and its run carries no `ParkSpec`).
    pub park_grace: Duration,
    /// The bytes of frames one parked run keeps before it stops reading
    /// its provider (R-PARK-1: a full buffer pauses the provider).
    pub park_kept_bytes: usize,
    /// Of durable requests, the share whose route continues an answer on
    /// another provider of its pool (R-CONT-1, opt-in per route): after
    /// commit a failed attempt continues from the durable prefix, and an
    /// orphan the Edge's custody takes over is continued from its journal
    /// rather than ended (R-TAKE-1).
    pub continue_ppm: u32,
    /// Takeovers and adoptions an Edge's custody runs at once
    /// ([`iop_core::edge::custody::CustodyConfig::max_tasks`]): the
    /// Edge's bound in most worlds, one to four in a quarter of them, so
    /// offers are let go busy and records left open wait for room (while
    /// one waits, durable requests are refused, R-TEN-2).
    pub custody_tasks: usize,
    /// Per fault tick, with store faults switched on: the journal store
    /// goes down (every sync, lease renewal and custody read fails) for
    /// up to [`Self::outage_max`]: long enough, at times, that requests
    /// give their terminals up and leave their records to the custody
    /// (R-JRN-4, R-JRN-6).
    pub outage_ppm: u32,
    /// How long a journal outage lasts at most.
    pub outage_max: Duration,
}

/// Tenants (SPEC §9): the keys and principals clients come with, their
/// limits and budgets, the model's price, and the shared store of their
/// counters every Edge claims from (R-TEN-1..3). Drawn from a stream of its
/// own, so the rest of a seed's world is what it was without tenants.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantProfile {
    /// Principals, by name, with their limits.
    pub principals: Vec<(String, iop_core::tenant::Limits)>,
    /// API keys: id, principal (an index into `principals`), limits.
    pub keys: Vec<(String, usize, iop_core::tenant::Limits)>,
    /// The models requests name (R-TEN-1: limits per model); every one
    /// at [`Self::price`].
    pub models: Vec<String>,
    /// The price of the world's models.
    pub price: iop_core::tenant::Price,
    /// Chunk and local share of every Edge's machine.
    pub machine: iop_core::tenant::TenantsConfig,
    /// The longest prompt a request sends, bytes (its bound in tokens,
    /// `prompt_tokens_max`).
    pub prompt_bytes_max: u64,
    /// The most output tokens a request asks for (no provider call emits
    /// more).
    pub output_tokens_max: u64,
    /// One hop between an Edge and the store: shortest.
    pub store_latency_min: Duration,
    /// One hop: longest.
    pub store_latency_max: Duration,
    /// While faults are on, per operation: it fails, nothing written.
    pub store_fail_ppm: u32,
    /// While faults are on, per written claim: its answer is lost (the
    /// Edge takes the store as failed; the allowance is lost, never granted
    /// twice).
    pub store_answer_lost_ppm: u32,
    /// While faults are on, per fault tick: the store goes down.
    pub store_outage_ppm: u32,
    /// How long an outage lasts at most.
    pub store_outage_max: Duration,
}

impl TenantProfile {
    /// The tenants of `seed`, if its world has any (in half of them).
    pub fn from_seed(seed: u64) -> Option<Self> {
        use iop_core::tenant::{Budget, Limits, Period, Price, TenantsConfig};
        let mut rng = Rng::new(seed ^ 0x7E4A_4175_C0DE_0003);
        if !rng.chance(PPM / 2) {
            return None;
        }
        let price = Price {
            input_per_mtok: rng.range(1, 3) * 1_000_000,
            output_per_mtok: rng.range(1, 5) * 1_000_000,
            ..Price::default()
        };
        let prompt_bytes_max = rng.range(8, 64);
        let output_tokens_max = u64::from(HEALTHY_TOKENS_MAX);
        // One request reserves about this much (an average prompt).
        let request_tokens = prompt_bytes_max / 2 + output_tokens_max;
        let request_spend = (prompt_bytes_max / 2) * price.input_per_mtok / 1_000_000
            + output_tokens_max * price.output_per_mtok / 1_000_000;
        // A budget from a few requests' worth (`small_ppm` of them: refused
        // early) to a whole run's (refused late, if at all).
        let limits = |rng: &mut Rng, budget_ppm: u32, small_ppm: u32, rate_ppm: u32| Limits {
            budget: rng.chance(budget_ppm).then(|| Budget {
                limit_micros: request_spend
                    * if rng.chance(small_ppm) {
                        rng.range(2, 30)
                    } else {
                        rng.range(30, 400)
                    },
                period: Period::Total,
            }),
            // Rates that bind at times: clients come every 20-400 ms.
            tokens_per_minute: rng
                .chance(rate_ppm)
                .then(|| request_tokens * rng.range(20, 1_500)),
            requests_per_minute: rng.chance(rate_ppm).then(|| rng.range(20, 1_500)),
            concurrent_requests: rng.chance(rate_ppm / 2).then(|| rng.range(2, 8)),
            ..Limits::default()
        };
        // Two or three principals, so a principal whose budget is spent
        // leaves the others' traffic going; its keys' budgets may be small.
        let principals: Vec<(String, Limits)> = (0..rng.range(2, 3))
            .map(|p| (format!("team-{p}"), limits(&mut rng, 500_000, 0, 300_000)))
            .collect();
        let mut keys = Vec::new();
        for p in 0..principals.len() {
            for k in 0..rng.range(1, 2) {
                let key = limits(&mut rng, 400_000, 250_000, 200_000);
                keys.push((format!("key-{p}-{k}"), p, key));
            }
        }
        let store_latency_min = Duration::from_micros(rng.range(100, 5_000));
        let mut profile = Self {
            principals,
            keys,
            models: ["sim", "sim-b"].map(String::from).to_vec(),
            price,
            machine: TenantsConfig {
                chunk_fraction: [0.02, 0.1, 0.25, 0.5][rng.index(4)],
                local_share: [0.25, 0.5, 1.0][rng.index(3)],
                slot_lease_ms: TenantsConfig::default().slot_lease_ms,
            },
            prompt_bytes_max,
            output_tokens_max,
            store_latency_min,
            store_latency_max: store_latency_min + rng.millis(0, 20),
            store_fail_ppm: rng.swarm(500_000, 5_000, 100_000),
            store_answer_lost_ppm: rng.swarm(400_000, 5_000, 100_000),
            store_outage_ppm: rng.swarm(300_000, 2_000, 20_000),
            store_outage_max: rng.millis(50, 3_000),
        };
        // Drawn last, so the draws above stay what they were: limits per
        // model (R-TEN-1) on some keys and principals, for one model or
        // both, tighter or looser than their whole limits.
        let model_limits = |rng: &mut Rng| iop_core::tenant::ModelLimits {
            requests_per_minute: rng.chance(PPM / 2).then(|| rng.range(10, 600)),
            tokens_per_minute: rng
                .chance(PPM / 3)
                .then(|| request_tokens * rng.range(10, 600)),
            concurrent_requests: rng.chance(PPM / 4).then(|| rng.range(1, 4)),
        };
        let models = profile.models.clone();
        let subjects = profile
            .principals
            .iter_mut()
            .map(|(_, l)| l)
            .chain(profile.keys.iter_mut().map(|(_, _, l)| l));
        for limits in subjects {
            if !rng.chance(PPM / 2) {
                continue;
            }
            for model in &models {
                if rng.chance(PPM * 2 / 3) {
                    limits
                        .per_model
                        .insert(model.clone(), model_limits(&mut rng));
                }
            }
        }
        Some(profile)
    }
}

impl JournalProfile {
    /// The longest round trip of one write: a sync already running, its
    /// own sync, the answer's way back (the queue holds less than one
    /// batch in these worlds).
    pub fn round_trip_max(&self) -> Duration {
        self.sync_max * 2 + self.ack_max
    }
}

/// Everything about one simulated world.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// The seed.
    pub seed: u64,
    /// Number of nodes.
    pub nodes: usize,
    /// Providers per node.
    pub providers_per_node: usize,
    /// Capacity of each provider.
    pub capacity: Vec<u32>,
    /// Stall timeout of each provider, ms (wire value).
    pub stall_timeout_ms: Vec<u64>,
    /// Admission queue capacity.
    pub queue_capacity: usize,
    /// Admission queue timeout.
    pub queue_timeout: Duration,
    /// Heartbeat interval (both sides).
    pub heartbeat_interval: Duration,
    /// Heartbeat wait (both sides).
    pub heartbeat_wait: Duration,
    /// Node reconnect backoff: first ceiling.
    pub backoff_initial: Duration,
    /// Node reconnect backoff: cap.
    pub backoff_max: Duration,
    /// How long a dial waits before it fails.
    pub connect_timeout: Duration,
    /// Watchdog close grace.
    pub close_grace: Duration,
    /// Watchdog probe bound.
    pub probe_bound: Duration,
    /// Longest time a probe takes to answer (when it answers).
    pub probe_delay_max: Duration,
    /// Gate: attempts per request.
    pub max_attempts: u32,
    /// Gate: total time per request. Also the liveness bound B_request:
    /// every request ends (one terminal, a client disconnect, or the Edge
    /// going away) at most this long after it was accepted, faults or not
    /// (`Checker::check_deadlines`).
    pub request_budget: Duration,
    /// Mean time between client requests.
    pub client_gap_mean: Duration,
    /// Edge CAPABILITIES cadence.
    pub capabilities_interval: Duration,
    /// The Edge's provider health tracker (its refresh is the capabilities
    /// cadence; its backoff cap stays within the eligibility bound).
    pub health: iop_core::edge::health::HealthConfig,
    /// One-way latency per node link, minimum.
    pub latency_min: Vec<Duration>,
    /// Jitter added on top, maximum, per node link.
    pub jitter_max: Vec<Duration>,
    /// Time between fault rolls.
    pub fault_tick: Duration,
    /// Process and network faults.
    pub faults: FaultProfile,
    /// Provider behaviours.
    pub provider: ProviderProfile,
    /// Durable responses.
    pub journal: JournalProfile,
    /// Tenants, their limits and the shared store of their counters
    /// (`None`: requests are held to no tenant's limits).
    pub tenants: Option<TenantProfile>,
}

impl SimConfig {
    /// The world of `seed` (swarm testing: the fault mix is part of it).
    pub fn from_seed(seed: u64) -> Self {
        // A separate stream for the configuration, so the world's own
        // stream starts the same way whatever the config drew.
        let mut rng = Rng::new(seed ^ 0x5EED_C0F1_6000_0001);
        let nodes = rng.range(1, 3) as usize;
        let providers_per_node = rng.range(1, 2) as usize;
        let total = nodes * providers_per_node;
        let capacity = (0..total).map(|_| rng.range(1, 3) as u32).collect();
        let stall_timeout_ms = (0..total).map(|_| rng.range(300, 1500)).collect();
        let heartbeat_interval = rng.millis(400, 2000);
        let heartbeat_wait = heartbeat_interval + rng.millis(200, 1500);
        let latency_min = (0..nodes).map(|_| rng.millis(1, 30)).collect();
        let jitter_max = (0..nodes).map(|_| rng.millis(0, 20)).collect();
        let faults = FaultProfile {
            conn_kill_ppm: rng.swarm(400_000, 100, 3_000),
            heartbeat_loss_ppm: rng.swarm(400_000, 1_000, 60_000),
            partition_ppm: rng.swarm(500_000, 2_000, 40_000),
            partition_one_way_ppm: rng.range(0, u64::from(PPM)) as u32,
            partition_max: rng.millis(100, 6000),
            node_crash_ppm: rng.swarm(500_000, 2_000, 25_000),
            node_down_max: rng.millis(50, 2000),
            edge_restart_ppm: rng.swarm(300_000, 1_000, 8_000),
            edge_down_max: rng.millis(50, 1500),
            client_cancel_ppm: rng.swarm(500_000, 10_000, 300_000),
            client_disconnect_ppm: rng.swarm(500_000, 10_000, 300_000),
            close_notice_ppm: rng.range(0, u64::from(PPM)) as u32,
            // Drawn last (below), so the draws above stay what they were.
            retransmit_ppm: 0,
            retransmit_max: Duration::ZERO,
            provider_freeze_ppm: 0,
            provider_freeze_max: Duration::ZERO,
            node_freeze_ppm: 0,
            node_freeze_forever_ppm: 0,
            node_freeze_max: Duration::ZERO,
        };
        let provider = ProviderProfile {
            slow_prefill_ppm: rng.swarm(500_000, 10_000, 300_000),
            stall_ppm: rng.swarm(500_000, 10_000, 300_000),
            hang_ppm: rng.swarm(400_000, 10_000, 200_000),
            error_ppm: rng.swarm(400_000, 10_000, 200_000),
            // Drawn last (below), so the draws above stay what they were.
            http_5xx_ppm: 0,
            abrupt_ppm: rng.swarm(400_000, 10_000, 200_000),
            return_within_grace_ppm: rng.range(0, u64::from(PPM)) as u32,
            never_return_ppm: rng.range(0, 500_000) as u32,
            probe_ok_ppm: rng.range(0, u64::from(PPM)) as u32,
            probe_unhealthy_ppm: rng.range(0, u64::from(PPM)) as u32,
            probe_error_ppm: rng.range(0, u64::from(PPM)) as u32,
        };
        let mut config = Self {
            seed,
            nodes,
            providers_per_node,
            capacity,
            stall_timeout_ms,
            queue_capacity: rng.range(1, 8) as usize,
            queue_timeout: rng.millis(500, 4000),
            heartbeat_interval,
            heartbeat_wait,
            backoff_initial: rng.millis(50, 300),
            backoff_max: rng.millis(500, 3000),
            connect_timeout: rng.millis(200, 1500),
            close_grace: rng.millis(50, 800),
            probe_bound: rng.millis(100, 1500),
            probe_delay_max: rng.millis(10, 2000),
            max_attempts: rng.range(1, 3) as u32,
            request_budget: rng.millis(2000, 10_000),
            client_gap_mean: rng.millis(20, 400),
            capabilities_interval: rng.millis(500, 3000),
            health: iop_core::edge::health::HealthConfig::default(),
            latency_min,
            jitter_max,
            fault_tick: Duration::from_millis(200),
            faults,
            provider,
            // Drawn last (below), so the draws above stay what they were.
            journal: JournalProfile {
                durable_ppm: 0,
                sync_min: Duration::ZERO,
                sync_max: Duration::ZERO,
                ack_max: Duration::ZERO,
                resume_ppm: 0,
                resume_delay_max: Duration::ZERO,
                sync_survives_ppm: 0,
                zombie_ppm: 0,
                zombie_late_ppm: 0,
                zombie_late_max: Duration::ZERO,
                crash_point_ppm: 0,
                end_crash_ppm: 0,
                sync_failure_ppm: 0,
                park_grace: Duration::ZERO,
                park_kept_bytes: iop_core::node::park::DEFAULT_MAX_KEPT_BYTES,
                continue_ppm: 0,
                custody_tasks: iop_core::edge::custody::MAX_TASKS,
                outage_ppm: 0,
                outage_max: Duration::ZERO,
            },
            tenants: TenantProfile::from_seed(seed),
        };
        // The tracker's refresh is the capabilities cadence; its backoff cap
        // stays within the eligibility bound. As the Edge's config requires,
        // an `ok` result outlives one refresh plus one probe timeout, so a
        // healthy provider never goes stale between its probes (R-HT-5).
        let caps = config.capabilities_interval;
        let probe_timeout = Duration::from_secs(5);
        config.health = iop_core::edge::health::HealthConfig {
            refresh_interval: caps,
            backoff_base: Duration::from_millis(100),
            backoff_cap: caps,
            stale_after: caps * 2 + probe_timeout,
            probe_timeout,
        };
        config.faults.retransmit_ppm = rng.swarm(500_000, 10_000, 150_000);
        config.faults.retransmit_max = rng.millis(40, 1500);
        config.faults.provider_freeze_ppm = rng.swarm(400_000, 5_000, 40_000);
        config.faults.provider_freeze_max = rng.millis(200, 3000);
        // Some worlds have big providers: many runs of one provider at once
        // (concurrent stalls of one provider, evidence overtaking evidence).
        if rng.chance(PPM / 2) {
            for c in &mut config.capacity {
                *c += rng.range(2, 6) as u32;
            }
        }
        // Durable responses, drawn after everything else: a seed without
        // them keeps its world (and its run) exactly.
        let sync_min = Duration::from_micros(rng.range(100, 3_000));
        config.journal = JournalProfile {
            durable_ppm: rng.swarm(600_000, 100_000, PPM),
            sync_min,
            sync_max: sync_min + rng.millis(0, 30),
            ack_max: rng.millis(0, 3),
            resume_ppm: rng.range(0, u64::from(PPM)) as u32,
            resume_delay_max: rng.millis(10, 2_000),
            sync_survives_ppm: rng.range(0, u64::from(PPM)) as u32,
            zombie_ppm: rng.swarm(800_000, 300_000, PPM),
            zombie_late_ppm: rng.range(300_000, u64::from(PPM)) as u32,
            zombie_late_max: Duration::ZERO,
            crash_point_ppm: rng.swarm(700_000, 1_000, 40_000),
            end_crash_ppm: 0,
            sync_failure_ppm: 0,
            park_grace: Duration::ZERO,
            park_kept_bytes: iop_core::node::park::DEFAULT_MAX_KEPT_BYTES,
            continue_ppm: 0,
            custody_tasks: iop_core::edge::custody::MAX_TASKS,
            outage_ppm: 0,
            outage_max: Duration::ZERO,
        };
        // Late zombies land around the takeover's raise and terminal: within
        // one or two of the store's longest round trips of the start.
        config.journal.zombie_late_max =
            config.journal.round_trip_max() * rng.range(1, 2) as u32 + Duration::from_millis(1);
        config.journal.sync_failure_ppm = rng.swarm(500_000, 5_000, 60_000);
        // Crash points are Edge restarts: only worlds that restart their
        // Edge have them (the others keep their coverage of everything else).
        if config.faults.edge_restart_ppm == 0 {
            config.journal.crash_point_ppm = 0;
        }
        // Parked runs (R-PARK-1/2), drawn last: in 7 worlds of 10 durable
        // runs park for a grace from shorter than a reconnect (they expire)
        // to long enough for any; in a third of those the kept frames are
        // bounded tightly enough to pause the provider.
        if rng.chance(700_000) {
            config.journal.park_grace = rng.millis(50, 4_000);
            if rng.chance(PPM / 3) {
                config.journal.park_kept_bytes = rng.range(64, 800) as usize;
            }
        }
        // Silent node loss and provider 5xx, drawn after everything else: a
        // seed where neither is enabled keeps its world and its run (a
        // disabled fault draws nothing from the world's stream).
        config.faults.node_freeze_ppm = rng.swarm(400_000, 2_000, 20_000);
        config.faults.node_freeze_forever_ppm = rng.range(0, 300_000) as u32;
        config.faults.node_freeze_max = rng.millis(100, 8_000);
        config.provider.http_5xx_ppm = rng.swarm(400_000, 10_000, 250_000);
        // Routes that continue (R-CONT-1), drawn last: in half the worlds a
        // share of durable requests continues its answer.
        config.journal.continue_ppm = rng.swarm(500_000, 100_000, PPM);
        // The end's crash point (R-TAKE-1), drawn last: in half the worlds
        // that restart their Edge, an Edge may die between a record's
        // journaled end and its terminal.
        let end_crash_ppm = rng.swarm(500_000, 20_000, 300_000);
        if config.faults.edge_restart_ppm > 0 {
            config.journal.end_crash_ppm = end_crash_ppm;
        }
        // The custody's size, from a stream of its own (the rest of the
        // world is what it was). The two streams' salts keep the worlds of
        // the regression seeds in `tests/simulation.rs` as they were.
        let mut small = Rng::new(seed ^ 0x7E4A_4175_C0DE_0017);
        if small.chance(PPM / 4) {
            config.journal.custody_tasks = small.range(1, 4) as usize;
        }
        // Journal outages (store faults only), from a stream of their own:
        // in half the worlds, up to a few per minute of faults, some
        // longer than a request's terminal writes.
        let mut outages = Rng::new(seed ^ 0x7E4A_4175_C0DE_0031);
        if outages.chance(PPM / 2) {
            config.journal.outage_ppm = outages.range(2_000, 20_000) as u32;
            config.journal.outage_max = outages.millis(500, 15_000);
        }
        config
    }

    /// Providers in the world.
    pub fn providers(&self) -> usize {
        self.nodes * self.providers_per_node
    }

    /// The longest one-way latency of any link.
    pub fn latency_max(&self) -> Duration {
        self.latency_min
            .iter()
            .zip(&self.jitter_max)
            .map(|(l, j)| *l + *j)
            .max()
            .unwrap_or_default()
    }

    /// Liveness bound B_node: after faults stop at `T_q`, every node is
    /// connected and ready (on both sides) by `T_q + B_node`, where
    ///
    /// ```text
    /// B_node = edge_down_max + node_down_max + heartbeat_interval + heartbeat_wait
    ///        + connect_timeout + backoff_max + partition_max + retransmit_max
    ///        + 10 * latency_max
    /// ```
    ///
    /// The Edge comes back, a crashed node restarts, a dead connection is
    /// noticed by the heartbeat, a dial in flight fails, the (capped) backoff
    /// wait passes, held partition traffic and retransmissions drain, and a
    /// fresh dial-register-ready handshake completes.
    pub fn node_recovery_bound(&self) -> Duration {
        self.faults.edge_down_max
            + self.faults.node_down_max
            + self.heartbeat_interval
            + self.heartbeat_wait
            + self.connect_timeout
            + self.backoff_max
            + self.faults.partition_max
            + self.faults.retransmit_max
            + self.latency_max() * 10
    }

    /// Liveness bound B_eligible: after faults stop at `T_q`, every provider
    /// is selectable again by `T_q + B_eligible`, where
    ///
    /// ```text
    /// B_eligible = max(B_node, request_budget + latency_max)
    ///            + 2 * capabilities_interval + probe_delay_max + 4 * latency_max
    /// ```
    ///
    /// The last stall evidence of a request opened before `T_q` lands at
    /// most one request budget after `T_q`; of the next two CAPABILITIES
    /// rounds, one may cross that stall terminal on another stream, the
    /// other carries a strictly newer `available`.
    pub fn eligibility_bound(&self) -> Duration {
        self.node_recovery_bound()
            .max(self.request_budget + self.latency_max())
            + self.capabilities_interval * 2
            + self.probe_delay_max
            + self.latency_max() * 4
            // A provider whose probes failed during the faults waits for its
            // capped backoff (R-HT-3) and one probe round trip.
            + self.health.backoff_cap
            + self.health.probe_timeout
    }

    /// Liveness bound B_durable: how much later than an ephemeral request
    /// a durable one may end. At its deadline it may still have one write
    /// in flight, one append of what is not yet written (a few events, one
    /// append) and its terminal to write (R-JRN-1: its terminal reaches the
    /// client only once durable), and a terminal the store failed is
    /// written again after `JOURNAL_RETRY`, up to `MAX_TERMINAL_WRITES`
    /// times (R-JRN-4):
    ///
    /// ```text
    /// B_durable = 3 * (2 * sync_max + ack_max)
    ///           + MAX_TERMINAL_WRITES * (JOURNAL_RETRY + 2 * sync_max + ack_max)
    /// ```
    pub fn durable_flush_bound(&self) -> Duration {
        // A terminal the store failed is written again after
        // `JOURNAL_RETRY`, at most `MAX_TERMINAL_WRITES` times in all
        // (R-JRN-4).
        let retries = iop_core::edge::durable::MAX_TERMINAL_WRITES;
        self.journal.round_trip_max() * 3
            + (iop_core::edge::request::JOURNAL_RETRY + self.journal.round_trip_max()) * retries
    }

    /// Liveness bound B_takeover: every record without a terminal at an
    /// Edge start ends within B_takeover of it, unless the Edge dies
    /// again first (R-TAKE-1):
    ///
    /// ```text
    /// B_takeover = zombie_late_max + 4 * (2 * sync_max + ack_max)
    /// ```
    ///
    /// The last zombie of an older incarnation lands by `zombie_late_max`;
    /// a raise in flight then may be refused by it (one round trip), the
    /// raise from the epoch read again wins (one) and the terminal is
    /// written (one); one more covers the first raise.
    pub fn takeover_bound(&self) -> Duration {
        self.journal.zombie_late_max + self.journal.round_trip_max() * 4
    }

    /// How long an Edge start leaves a record it did not write for its
    /// node to report the run parked (R-TAKE-1, R-PARK-2): the park grace
    /// and the slack for the node's reconnect and report (the shell's
    /// `park_window`); zero when runs do not park.
    pub fn park_window(&self) -> Duration {
        if self.journal.park_grace.is_zero() {
            Duration::ZERO
        } else {
            self.journal.park_grace + iop_core::edge::request::PARK_REPORT_SLACK
        }
    }
}

/// The longest healthy generation, so the fault-free part of a run has a
/// known service time.
pub const HEALTHY_TOKENS_MAX: u32 = 12;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_fixes_its_world() {
        assert_eq!(SimConfig::from_seed(7), SimConfig::from_seed(7));
        assert_ne!(SimConfig::from_seed(7), SimConfig::from_seed(8));
    }

    #[test]
    fn swarm_enables_different_fault_mixes() {
        let mixes: std::collections::BTreeSet<(bool, bool, bool)> = (0..64)
            .map(SimConfig::from_seed)
            .map(|c| {
                (
                    c.faults.partition_ppm > 0,
                    c.faults.node_crash_ppm > 0,
                    c.provider.stall_ppm > 0,
                )
            })
            .collect();
        assert!(mixes.len() >= 6, "{mixes:?}");
    }

    #[test]
    fn stall_timeouts_are_valid_wire_values() {
        for seed in 0..64 {
            for ms in SimConfig::from_seed(seed).stall_timeout_ms {
                assert!(iop_core::node::watchdog::effective_stall_timeout(ms).is_ok());
            }
        }
    }
}
