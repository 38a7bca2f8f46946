//! Core hot paths, in events per second (criterion's `elem/s`):
//!
//! * `watchdog_progress`: one provider output reported to the Node's stall
//!   watchdog (R-WD-1), with 1, 1,000 and 10,000 runs watched;
//! * `admission_request_release`: one lease granted and released
//!   (R-LEASE-2), with 0, 1,000 and 10,000 other leases held;
//! * `admission_full_queue`: on an Edge at capacity, one lease released
//!   (which serves the queue's head), the next deadline asked, one more
//!   request queued and one queued request canceled, with 1, 1,000 and
//!   10,000 requests waiting (the dispatcher does this under the Edge's
//!   lock; the 1-request queue is the baseline of the same run);
//! * `overlay_apply`: one stall evidence and one CAPABILITIES verdict
//!   applied to the runtime overlay (R-OVL-2, R-CAP-1), over 16 providers;
//! * `tunnel_meter`: one chunk of a tunnelled OpenAI stream read for its
//!   usage by the Edge (R-TEN-2), beside `copy`, the same chunk copied as
//!   the relay copies it (the baseline of the same run).
//!
//! Run: `cargo bench -p iop-bench --bench core`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use iop_core::Instant;
use iop_core::edge::admission::{
    Admission, AdmissionConfig, AdmissionEvent, Admit, DispatchRequest, ProviderSpec, ReleaseReason,
};
use iop_core::edge::overlay::Overlay;
use iop_core::ids::{NodeId, ProviderId};
use iop_core::node::watchdog::{Emission, Progress, RunKind, Watchdog, WatchdogConfig};
use iop_wire::{AdapterKind, ProviderHealth};

/// Events per measured iteration.
const BATCH: u64 = 1_000;

fn watchdog_progress(c: &mut Criterion) {
    let mut group = c.benchmark_group("watchdog_progress");
    group.throughput(Throughput::Elements(BATCH));
    for runs in [1u64, 1_000, 10_000] {
        let config = WatchdogConfig {
            max_active_runs: runs as usize,
            ..WatchdogConfig::default()
        };
        let mut wd = Watchdog::new(config, None);
        let stall = Duration::from_secs(300);
        for id in 0..runs {
            wd.start(Instant::ZERO, id, RunKind::Normalized, stall, None)
                .expect("within max_active_runs");
        }
        // Time moves 1 µs per event: far from any stall moment, as in a
        // healthy stream.
        let mut now_us = 1u64;
        group.bench_with_input(BenchmarkId::from_parameter(runs), &runs, |b, &runs| {
            b.iter(|| {
                for i in 0..BATCH {
                    now_us += 1;
                    let e = wd.progress(Instant::from_micros(now_us), i % runs, Progress::Content);
                    assert!(black_box(e) == Emission::Forward);
                }
            });
        });
        assert_eq!(wd.active_runs(), runs as usize);
    }
    group.finish();
}

fn provider(i: usize, capacity: u32) -> ProviderSpec {
    ProviderSpec {
        id: ProviderId::new(format!("p{i}")),
        node: NodeId::new(format!("n{i}")),
        adapter: AdapterKind::OpenAi,
        target: "t".into(),
        capacity,
        stall_timeout_ms: 0,
    }
}

/// Admission over two providers of `capacity` each, both online, a queue
/// of `queue_capacity`: the admission, the pool naming both, and now.
fn two_providers_online(
    capacity: u32,
    queue_capacity: usize,
) -> (Admission, Vec<ProviderId>, Instant) {
    let specs = vec![provider(0, capacity), provider(1, capacity)];
    let pool: Vec<ProviderId> = specs.iter().map(|s| s.id.clone()).collect();
    let config = AdmissionConfig {
        queue_capacity,
        queue_timeout: Duration::from_secs(30),
    };
    let mut adm = Admission::new(config, specs.clone());
    let now = Instant::from_millis(1);
    for s in &specs {
        adm.set_online(now, &s.id, Some(1));
    }
    (adm, pool, now)
}

fn admission_request_release(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission_request_release");
    // One request and one release per round.
    group.throughput(Throughput::Elements(2 * BATCH));
    for held in [0u64, 1_000, 10_000] {
        let (mut adm, pool, now) = two_providers_online(20_000, 256);
        let mut next_id = 0u64;
        for _ in 0..held {
            next_id += 1;
            assert!(matches!(
                adm.request(now, DispatchRequest::new(next_id, pool.clone())),
                Admit::Leased(_)
            ));
        }
        group.bench_with_input(BenchmarkId::from_parameter(held), &held, |b, _| {
            b.iter(|| {
                for _ in 0..BATCH {
                    next_id += 1;
                    match adm.request(now, DispatchRequest::new(next_id, pool.clone())) {
                        Admit::Leased(lease) => {
                            let released =
                                adm.release(now, lease.lease_id, ReleaseReason::Terminal);
                            black_box(released.is_ok());
                        }
                        other => panic!("expected a lease, got {other:?}"),
                    }
                }
            });
        });
        assert_eq!(adm.leases_in_use(), held as usize);
    }
    group.finish();
}

fn admission_full_queue(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission_full_queue");
    // One release (serving the head), one deadline asked, one request
    // queued and one canceled per round.
    group.throughput(Throughput::Elements(BATCH));
    for waiting in [1u64, 1_000, 10_000] {
        let (mut adm, pool, now) = two_providers_online(4, waiting as usize + 1);
        let mut next_id = 0u64;
        let mut leases = std::collections::VecDeque::new();
        while let Admit::Leased(lease) = {
            next_id += 1;
            adm.request(now, DispatchRequest::new(next_id, pool.clone()))
        } {
            leases.push_back(lease.lease_id);
        }
        // The request that found no room is queued; fill the queue.
        for _ in 1..waiting {
            next_id += 1;
            let admit = adm.request(now, DispatchRequest::new(next_id, pool.clone()));
            assert_eq!(admit, Admit::Queued);
        }
        group.bench_with_input(BenchmarkId::from_parameter(waiting), &waiting, |b, _| {
            b.iter(|| {
                for _ in 0..BATCH {
                    let oldest = leases.pop_front().expect("at capacity");
                    let released = adm.release(now, oldest, ReleaseReason::Terminal);
                    black_box(released.is_ok());
                    match adm.poll_event() {
                        Some(AdmissionEvent::Leased(lease)) => leases.push_back(lease.lease_id),
                        other => panic!("expected the head served, got {other:?}"),
                    }
                    black_box(adm.poll_timeout());
                    next_id += 1;
                    let admit = adm.request(now, DispatchRequest::new(next_id, pool.clone()));
                    assert_eq!(admit, Admit::Queued);
                    next_id += 1;
                    let admit = adm.request(now, DispatchRequest::new(next_id, pool.clone()));
                    assert_eq!(admit, Admit::Queued);
                    black_box(adm.cancel(now, next_id));
                }
            });
        });
        assert_eq!(adm.queue_depth(), waiting as usize);
    }
    group.finish();
}

fn overlay_apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("overlay_apply");
    // One stall evidence and one CAPABILITIES verdict per round.
    group.throughput(Throughput::Elements(2 * BATCH));
    let providers: Vec<ProviderId> = (0..16).map(|i| ProviderId::new(format!("p{i}"))).collect();
    let mut overlay = Overlay::new();
    let mut seq = 0u64;
    group.bench_function("16_providers", |b| {
        b.iter(|| {
            for i in 0..BATCH as usize {
                let p = &providers[i % providers.len()];
                seq += 1;
                black_box(overlay.apply_stall_evidence(
                    p,
                    1,
                    Some(seq),
                    ProviderHealth::Unavailable,
                ));
                seq += 1;
                black_box(overlay.apply_capability(p, 1, seq, ProviderHealth::Available));
            }
        });
    });
    group.finish();
}

fn tunnel_meter(c: &mut Criterion) {
    use iop_core::edge::request::TunnelApi;
    use iop_core::edge::tunnel_meter::TunnelMeter;
    // A streamed chunk of one token, as OpenAI-compatible servers send it.
    let chunk = br#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}],"usage":null}

"#;
    let mut group = c.benchmark_group("tunnel_meter");
    group.throughput(Throughput::Elements(BATCH));
    group.bench_function("copy", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                black_box(black_box(&chunk[..]).to_vec());
            }
        });
    });
    group.bench_function("read", |b| {
        b.iter(|| {
            let mut meter = TunnelMeter::new(TunnelApi::OpenAi, Some("text/event-stream"));
            for _ in 0..BATCH {
                let bytes = black_box(&chunk[..]).to_vec();
                meter.feed(&bytes);
                black_box(bytes);
            }
            assert_eq!(black_box(meter.output_estimate()), BATCH);
        });
    });
    group.finish();
}

criterion_group!(
    benches,
    watchdog_progress,
    admission_request_release,
    admission_full_queue,
    overlay_apply,
    tunnel_meter
);
criterion_main!(benches);
