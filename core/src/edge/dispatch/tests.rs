use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use iop_wire::{AdapterKind, HealthFailureCode, PROTOCOL_VERSION, TargetHealth};

use crate::edge::gate::AttemptEvent;
use crate::edge::health::HealthState;
use proptest::prelude::*;

use super::*;

fn spec(id: &str, node: &str, capacity: u32) -> ProviderSpec {
    ProviderSpec {
        id: ProviderId::from(id),
        node: NodeId::from(node),
        adapter: AdapterKind::Mock,
        target: format!("t-{id}"),
        capacity,
        stall_timeout_ms: 2000,
    }
}

fn dispatcher() -> Dispatcher {
    dispatcher_with(HealthConfig::default())
}

fn dispatcher_with(health: HealthConfig) -> Dispatcher {
    Dispatcher::new(Instant::ZERO, test_config(health)).expect("valid config")
}

fn test_config(health: HealthConfig) -> DispatchConfig {
    DispatchConfig {
        admission: AdmissionConfig {
            queue_capacity: 4,
            queue_timeout: Duration::from_millis(500),
        },
        providers: vec![spec("p1", "a", 1), spec("p2", "a", 2), spec("p3", "b", 1)],
        generation_floor: 100,
        generation_mark: None,
        known_nodes: None,
        health,
        capacity_from_node: Default::default(),
        parked_hold_ms: 0,
    }
}

fn register_req() -> RegisterRequest {
    RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        node_version: "t".into(),
        providers: vec![],
        max_concurrent_runs: 8,
        recipient_public_key: None,
        parked: Vec::new(),
    }
}

fn stall(health: ProviderHealth, seq: u64) -> ExecutionFailure {
    ExecutionFailure {
        provider_health: Some(health),
        liveness_classification: Some(health.liveness_classification()),
        health_observation_seq: Some(seq),
        ..ExecutionFailure::new(FailureCode::ResponseStalled)
    }
}

fn caps(target: &str, status: ProviderHealth, seq: u64) -> CapabilitiesReport {
    CapabilitiesReport {
        targets: vec![TargetHealth {
            adapter: AdapterKind::Mock,
            target: target.into(),
            status,
            failure_code: None,
            models: vec![],
        }],
        health_observation_seq: seq,
    }
}

const T: Instant = Instant::ZERO;

/// Register and ready `node`; its providers' first probes are answered
/// `available` (observation sequence 0), so they are selectable (R-HT-5:
/// before that first answer they are `unknown`, not eligible). Outputs
/// other than those probes are left in the queue, in order.
fn up(d: &mut Dispatcher, node: &str) -> Generation {
    let g = up_unprobed(d, node);
    answer_first_probes(d, node, g);
    g
}

/// Answer the probes due for `node`'s providers `available` (observation
/// sequence 0); other outputs stay queued, in order.
fn answer_first_probes(d: &mut Dispatcher, node: &str, g: Generation) {
    let n = NodeId::from(node);
    let mut kept = Vec::new();
    let mut tickets = Vec::new();
    while let Some(out) = d.poll_output() {
        match out {
            DispatchOutput::ProbeDue {
                ticket, node: of, ..
            } if of == n => tickets.push(ticket),
            other => kept.push(other),
        }
    }
    for ticket in tickets {
        let target = format!("t-{}", ticket.provider_id.as_str());
        let report = caps(&target, ProviderHealth::Available, 0);
        let (disposition, _) = d.probe_answer(T, &ticket, Ok((&n, g, &report)));
        assert_eq!(disposition, ProbeDisposition::Applied);
    }
    kept.extend(std::iter::from_fn(|| d.poll_output()));
    d.outputs.extend(kept);
}

/// Register and ready `node` with its first probes still unanswered.
fn up_unprobed(d: &mut Dispatcher, node: &str) -> Generation {
    let n = NodeId::from(node);
    let (g, _) = d.register(T, &n, &register_req()).unwrap();
    assert!(d.ready(T, &n, g));
    g
}

fn leased(a: Admit) -> Lease {
    match a {
        Admit::Leased(l) => l,
        other => panic!("expected a lease, got {other:?}"),
    }
}

fn all_pool() -> Vec<ProviderId> {
    ["p1", "p2", "p3"].map(ProviderId::from).to_vec()
}

#[test]
fn register_snapshot_lists_that_nodes_providers_with_stall_timeouts() {
    let mut d = dispatcher();
    let (g, snap) = d.register(T, &NodeId::from("a"), &register_req()).unwrap();
    assert_eq!(g, 101, "generations start above the floor");
    let ids: Vec<_> = snap
        .providers
        .iter()
        .map(|p| p.provider_id.as_str())
        .collect();
    assert_eq!(ids, vec!["p1", "p2"]);
    assert!(
        snap.providers
            .iter()
            .all(|p| p.response_stall_timeout_ms == 2000)
    );
}

fn dispatcher_with_mark(mark: Option<Generation>) -> Dispatcher {
    let mut config = test_config(HealthConfig::default());
    config.generation_mark = mark;
    Dispatcher::new(T, config).expect("valid config")
}

fn register_input(node: &str) -> DispatchInput {
    DispatchInput::Register {
        node: NodeId::from(node),
        request: register_req(),
    }
}

fn outputs_of(d: &mut Dispatcher, input: DispatchInput) -> Vec<DispatchOutput> {
    d.handle_input(T, input);
    std::iter::from_fn(|| d.poll_output()).collect()
}

fn saves_in(outputs: &[DispatchOutput]) -> Vec<Generation> {
    outputs
        .iter()
        .filter_map(|o| match o {
            DispatchOutput::SaveGenerationMark { mark } => Some(*mark),
            _ => None,
        })
        .collect()
}

fn registered_in(outputs: &[DispatchOutput]) -> Result<Generation, RejectCause> {
    match outputs.first() {
        Some(DispatchOutput::Registered { result, .. }) => {
            result.as_ref().map(|(g, _)| *g).map_err(|r| r.cause)
        }
        other => panic!("the answer comes first: {other:?}"),
    }
}

/// R-GEN-1 across restarts: a generation is used only when the persisted
/// mark covers it. The dispatcher asks for the next mark ahead of need;
/// a registration that outruns the save is refused, its generation fenced
/// at once (never dispatched to), and the node's earlier connection is
/// replaced all the same.
#[test]
fn a_generation_past_the_persisted_mark_is_refused_until_a_save_covers_it_r_gen_1() {
    use crate::edge::generations::RESERVE_AHEAD;
    let mut d = dispatcher_with_mark(Some(101));
    let out = outputs_of(&mut d, register_input("a"));
    assert_eq!(registered_in(&out), Ok(101), "at the mark: covered");
    assert_eq!(saves_in(&out), vec![101 + RESERVE_AHEAD]);
    let out = outputs_of(
        &mut d,
        DispatchInput::Ready {
            node: NodeId::from("a"),
            generation: 101,
        },
    );
    assert!(matches!(
        out.first(),
        Some(DispatchOutput::ReadyAnswer { accepted: true, .. })
    ));
    // The save is still in flight: 102 is past the mark.
    let out = outputs_of(&mut d, register_input("a"));
    assert_eq!(registered_in(&out), Err(RejectCause::GenerationNotDurable));
    assert!(saves_in(&out).is_empty(), "one save at a time");
    assert!(
        out.iter().any(|o| matches!(
            o,
            DispatchOutput::Fenced {
                generation: 102,
                reason: CloseCode::RegistrationRejected,
                ..
            }
        )),
        "the refused generation is fenced: {out:?}"
    );
    assert!(!d.registry().is_dispatchable(&NodeId::from("a"), 101));
    assert!(!d.registry().is_dispatchable(&NodeId::from("a"), 102));
    let out = outputs_of(
        &mut d,
        DispatchInput::Ready {
            node: NodeId::from("a"),
            generation: 102,
        },
    );
    assert!(
        matches!(
            out.first(),
            Some(DispatchOutput::ReadyAnswer {
                accepted: false,
                ..
            })
        ),
        "never dispatched to"
    );
    // Saved: the next registration is covered.
    let out = outputs_of(
        &mut d,
        DispatchInput::GenerationMarkSaved {
            mark: 101 + RESERVE_AHEAD,
            saved: true,
        },
    );
    assert!(out.is_empty());
    let out = outputs_of(&mut d, register_input("a"));
    assert_eq!(registered_in(&out), Ok(103));
    assert!(saves_in(&out).is_empty(), "plenty of the reserve is left");
}

/// A failed save leaves the mark where it was and is asked for again by
/// the next registration; a dispatcher without a store never asks.
#[test]
fn a_failed_save_is_asked_for_again_and_no_store_means_no_save_r_gen_1() {
    use crate::edge::generations::RESERVE_AHEAD;
    let mut d = dispatcher_with_mark(Some(101));
    let out = outputs_of(&mut d, register_input("a"));
    assert_eq!(saves_in(&out), vec![101 + RESERVE_AHEAD]);
    d.handle_input(
        T,
        DispatchInput::GenerationMarkSaved {
            mark: 101 + RESERVE_AHEAD,
            saved: false,
        },
    );
    let out = outputs_of(&mut d, register_input("b"));
    assert_eq!(registered_in(&out), Err(RejectCause::GenerationNotDurable));
    assert_eq!(saves_in(&out), vec![102 + RESERVE_AHEAD], "asked again");

    let mut d = dispatcher_with_mark(None);
    for node in ["a", "b", "a", "b"] {
        let out = outputs_of(&mut d, register_input(node));
        assert!(registered_in(&out).is_ok());
        assert!(saves_in(&out).is_empty());
    }
}

/// A provider without a configured capacity takes its node's reported
/// limit for the target at registration; a configured one keeps its own.
#[test]
fn a_provider_without_configured_capacity_takes_its_nodes_reported_limit() {
    let mut d = Dispatcher::new(
        T,
        DispatchConfig {
            admission: AdmissionConfig {
                queue_capacity: 4,
                queue_timeout: Duration::from_millis(500),
            },
            providers: vec![spec("p1", "a", 4), spec("p2", "a", 4)],
            generation_floor: 100,
            generation_mark: None,
            known_nodes: None,
            health: HealthConfig::default(),
            capacity_from_node: [ProviderId::from("p1")].into_iter().collect(),
            parked_hold_ms: 0,
        },
    )
    .expect("valid config");
    let offered = |target: &str, limit: Option<u32>| iop_wire::OfferedProvider {
        adapter: AdapterKind::Mock,
        target: target.into(),
        models: vec![],
        max_concurrent_runs: limit,
    };
    let mut req = register_req();
    // Listed out of order: each provider takes its own entry, matched by
    // adapter and target both.
    req.providers = vec![offered("t-p2", Some(9)), offered("t-p1", Some(2))];
    let a = NodeId::from("a");
    let (g, _) = d.register(T, &a, &req).unwrap();
    assert!(d.ready(T, &a, g));
    answer_first_probes(&mut d, "a", g);
    let capacity = |d: &Dispatcher, p: &str| {
        d.admission()
            .capacity_view()
            .into_iter()
            .find(|c| c.provider_id.as_str() == p)
            .map(|c| c.capacity)
    };
    assert_eq!(capacity(&d, "p1"), Some(2), "the node's limit");
    assert_eq!(capacity(&d, "p2"), Some(4), "the configured capacity wins");
    // Two leases on p1, the third request waits.
    let pool = vec![ProviderId::from("p1")];
    leased(d.request(T, DispatchRequest::new(1, pool.clone())));
    leased(d.request(T, DispatchRequest::new(2, pool.clone())));
    assert_eq!(d.request(T, DispatchRequest::new(3, pool)), Admit::Queued);
    // A node that reports none leaves the capacity as it was.
    d.connection_closed(T, &a, g, CloseCode::Normal);
    req.providers = vec![offered("t-p1", None)];
    d.register(T, &a, &req).unwrap();
    assert_eq!(capacity(&d, "p1"), Some(2));
}

#[test]
fn nothing_is_leased_before_readiness() {
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let (g, _) = d.register(T, &a, &register_req()).unwrap();
    assert_eq!(
        d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])),
        Admit::Queued
    );
    d.ready(T, &a, g);
    // Leased once its provider's first probe answered (R-HT-5).
    answer_first_probes(&mut d, "a", g);
    let outs: Vec<_> = std::iter::from_fn(|| d.poll_output()).collect();
    assert!(
        outs.iter()
            .any(|o| matches!(o, DispatchOutput::ToRequest { event: RequestEvent::Leased(l), .. } if l.generation == g))
    );
}

#[test]
fn disconnect_releases_leases_of_that_generation_and_reports_them() {
    let mut d = dispatcher();
    let g = up(&mut d, "a");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    d.connection_closed(T, &NodeId::from("a"), g, CloseCode::HeartbeatTimeout);
    let outs: Vec<_> = std::iter::from_fn(|| d.poll_output()).collect();
    assert!(outs.contains(&DispatchOutput::ToRequest {
        request_id: 1,
        event: RequestEvent::LeaseFenced(l.clone())
    }));
    assert_eq!(d.admission().leases_in_use(), 0);
    // Its late terminal is ignored and counted.
    let v = d.apply_terminal(T, l.lease_id, &NodeId::from("a"), g, None);
    assert_eq!(
        v,
        TerminalVerdict::Ignored(IgnoredTerminal::FencedGeneration)
    );
    assert_eq!(d.registry().fenced_messages(), 1);
}

/// R-FAIL-3: a provider whose runs fail (a 5xx each) leaves selection
/// after `RUN_FAILURES_TO_UNAVAILABLE` in a row, with its outage reported;
/// the other providers of the node stay selectable; a client's 4xx or a
/// cancel counts for nothing.
#[test]
fn r_fail_3_a_provider_failing_its_runs_leaves_selection_and_only_it() {
    use crate::edge::health::RUN_FAILURES_TO_UNAVAILABLE;
    let mut d = dispatcher();
    let g = up(&mut d, "a");
    let a = NodeId::from("a");
    let p1 = ProviderId::from("p1");
    let failure = |code, status| ExecutionFailure {
        http_status: status,
        ..ExecutionFailure::new(code)
    };
    let mut request_id = 0;
    let mut run = |d: &mut Dispatcher, f: ExecutionFailure| {
        request_id += 1;
        let l = leased(d.request(T, DispatchRequest::new(request_id, vec![p1.clone()])));
        let v = d.apply_terminal(T, l.lease_id, &a, g, Some(&f));
        assert!(matches!(v, TerminalVerdict::Applied { .. }), "{v:?}");
    };
    // Neither the client's error nor a cancel is the provider's fault.
    for _ in 0..5 {
        run(&mut d, failure(FailureCode::ProviderError, Some(400)));
        run(&mut d, failure(FailureCode::Canceled, None));
    }
    assert!(d.admission().is_selectable(&p1));
    let _ = drain_outputs(&mut d);
    for _ in 0..RUN_FAILURES_TO_UNAVAILABLE {
        assert!(d.admission().is_selectable(&p1));
        run(&mut d, failure(FailureCode::ProviderError, Some(503)));
    }
    assert!(!d.admission().is_selectable(&p1), "out of selection");
    assert!(
        d.admission().is_selectable(&ProviderId::from("p2")),
        "isolation"
    );
    let outputs = drain_outputs(&mut d);
    assert!(
        outputs.iter().any(|o| matches!(
            o,
            DispatchOutput::Health(e)
                if e.provider_id == p1
                    && e.lifecycle == crate::edge::health::HealthLifecycle::Detected
                    && e.failure_code == Some(HealthFailureCode::Http5xx)
        )),
        "{outputs:?}"
    );
}

#[test]
fn terminal_from_a_foreign_generation_is_ignored_and_keeps_the_lease() {
    let mut d = dispatcher();
    up(&mut d, "a");
    let gb = up(&mut d, "b");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    let v = d.apply_terminal(T, l.lease_id, &NodeId::from("b"), gb, None);
    assert_eq!(v, TerminalVerdict::Ignored(IgnoredTerminal::Mismatch));
    assert!(d.admission().lease(l.lease_id).is_some());
}

#[test]
fn ignored_terminals_are_counted_under_closed_labels_r_lease_1() {
    let mut d = dispatcher();
    let ga = up(&mut d, "a");
    let gb = up(&mut d, "b");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    assert_eq!(d.ignored_terminals(), 0);
    d.apply_terminal(T, l.lease_id, &NodeId::from("b"), gb, None);
    assert_eq!(d.ignored_terminals(), 1);
    d.apply_terminal(T, l.lease_id + 1000, &NodeId::from("a"), ga, None);
    assert_eq!(d.ignored_terminals(), 2);
    let labels = [
        IgnoredTerminal::NotHeld,
        IgnoredTerminal::FencedGeneration,
        IgnoredTerminal::Mismatch,
    ]
    .map(IgnoredTerminal::as_str);
    assert_eq!(labels, ["not_held", "fenced_generation", "mismatch"]);
}

#[test]
fn a_cancel_returns_the_lease_it_released_so_its_run_is_canceled_r_gate_4() {
    let mut d = dispatcher();
    up(&mut d, "a");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    assert_eq!(
        d.request(T, DispatchRequest::new(2, vec![ProviderId::from("p1")])),
        Admit::Queued
    );
    assert_eq!(d.cancel(T, 2), None, "a queued request holds no lease");
    assert_eq!(d.cancel(T, 1), Some(l.clone()));
    assert!(d.admission().lease(l.lease_id).is_none());
    assert_eq!(d.cancel(T, 1), None, "released once");
}

#[test]
fn the_timer_is_the_earliest_due_deadline_and_none_when_idle() {
    let mut d = dispatcher();
    assert_eq!(d.poll_timeout(), None, "no node, no queue, no probe");
    // A request queued with nothing online expires after the queue timeout.
    assert_eq!(
        d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])),
        Admit::Queued
    );
    assert_eq!(
        d.poll_timeout(),
        Some(T + Duration::from_millis(500)),
        "the queue entry's expiry"
    );
}

#[test]
fn only_the_current_generations_messages_are_admitted_r_gen_3() {
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let g1 = up(&mut d, "a");
    assert!(d.admit_message(&a, g1));
    d.connection_closed(T, &a, g1, CloseCode::Normal);
    let g2 = up(&mut d, "a");
    assert!(g2 > g1);
    assert!(d.admit_message(&a, g2), "the new connection's");
    assert!(!d.admit_message(&a, g1), "the fenced one's");
}

#[test]
fn valid_stall_terminal_is_handed_off_confirmed_and_fresh_unavailable_lowers() {
    let mut d = dispatcher();
    let g = up(&mut d, "a");
    let a = NodeId::from("a");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    let v = d.apply_terminal(
        T,
        l.lease_id,
        &a,
        g,
        Some(&stall(ProviderHealth::Unavailable, 1)),
    );
    assert_eq!(
        v,
        TerminalVerdict::Applied {
            lease: l,
            stall: Some(ConfirmedStall {
                provider_id: ProviderId::from("p1"),
                health: ProviderHealth::Unavailable
            }),
            evidence: Some(EvidenceOutcome::Lowered),
        }
    );
    assert!(!d.admission().is_selectable(&ProviderId::from("p1")));
    // A stale available answer does not recover it; a strictly newer one does.
    let v = d.apply_capabilities(T, &a, g, &caps("t-p1", ProviderHealth::Available, 1));
    assert_eq!(v[0].recovery, RecoveryOutcome::Stale);
    let v = d.apply_capabilities(T, &a, g, &caps("t-p1", ProviderHealth::Available, 2));
    assert_eq!(v[0].recovery, RecoveryOutcome::Recovered);
    assert!(d.admission().is_selectable(&ProviderId::from("p1")));
}

#[test]
fn ambiguous_capabilities_answer_changes_nothing() {
    let mut d = dispatcher();
    let g = up(&mut d, "a");
    let a = NodeId::from("a");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    d.apply_terminal(
        T,
        l.lease_id,
        &a,
        g,
        Some(&stall(ProviderHealth::Unavailable, 1)),
    );
    let mut report = caps("t-p1", ProviderHealth::Available, 5);
    report.targets.push(report.targets[0].clone());
    assert!(d.apply_capabilities(T, &a, g, &report).is_empty());
    assert!(d.overlay().is_lowered(&ProviderId::from("p1"), g));
    // An answer about another target does not match p1.
    let v = d.apply_capabilities(T, &a, g, &caps("t-zzz", ProviderHealth::Available, 6));
    assert!(v.is_empty());
    assert!(d.overlay().is_lowered(&ProviderId::from("p1"), g));
}

#[test]
fn capabilities_from_a_fenced_generation_are_ignored() {
    let mut d = dispatcher();
    let g1 = up(&mut d, "a");
    let a = NodeId::from("a");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    d.apply_terminal(
        T,
        l.lease_id,
        &a,
        g1,
        Some(&stall(ProviderHealth::Unavailable, 1)),
    );
    let g2 = up(&mut d, "a");
    assert!(g2 > g1);
    assert!(
        d.admission().is_selectable(&ProviderId::from("p1")),
        "a new generation starts with a clean overlay"
    );
    assert!(
        d.apply_capabilities(T, &a, g1, &caps("t-p1", ProviderHealth::Available, 9))
            .is_empty()
    );
}

#[test]
fn capabilities_recovery_does_not_make_an_unavailable_provider_selectable() {
    let mut d = dispatcher();
    let g = up(&mut d, "a");
    let a = NodeId::from("a");
    let p1 = ProviderId::from("p1");
    // The overlay is lowered by a stall, and p1's next health probe fails.
    let l = leased(d.request(T, DispatchRequest::new(1, vec![p1.clone()])));
    d.apply_terminal(
        T,
        l.lease_id,
        &a,
        g,
        Some(&stall(ProviderHealth::Unavailable, 1)),
    );
    let later = T + Duration::from_secs(30);
    d.handle_timeout(later);
    let ticket = probe_due(&mut d, &p1);
    let (disposition, _) = d.probe_answer(later, &ticket, Err(HealthFailureCode::TransportFailed));
    assert_eq!(disposition, ProbeDisposition::Applied);
    assert_eq!(d.health().state(&p1), Some(HealthState::Unavailable));
    // R-CAP-1 raises the overlay, but R-HT-5 still holds p1 back.
    let v = d.apply_capabilities(later, &a, g, &caps("t-p1", ProviderHealth::Available, 2));
    assert_eq!(v[0].recovery, RecoveryOutcome::Recovered);
    assert!(!d.overlay().is_lowered(&p1, g));
    assert!(!d.admission().is_selectable(&p1), "R-HT-5: fail closed");
    assert_eq!(
        d.request(later, DispatchRequest::new(2, vec![p1.clone()])),
        Admit::Queued
    );
    assert_eq!(d.cancel(later, 2), None);
    // Its recovery probe, due after the backoff, brings it back (R-HT-3).
    let retry_at = d
        .health()
        .provider_snapshot(&p1)
        .and_then(|s| s.next_retry_at)
        .expect("a failing provider has a retry moment");
    d.handle_timeout(retry_at);
    let retry = std::iter::from_fn(|| d.poll_output())
        .find_map(|o| match o {
            DispatchOutput::ProbeDue { ticket, .. } if ticket.provider_id == p1 => Some(ticket),
            _ => None,
        })
        .expect("the recovery probe is due");
    let report = caps("t-p1", ProviderHealth::Available, 3);
    let (disposition, _) = d.probe_answer(retry_at, &retry, Ok((&a, g, &report)));
    assert_eq!(disposition, ProbeDisposition::Applied);
    assert!(d.admission().is_selectable(&p1));
    leased(d.request(retry_at, DispatchRequest::new(3, vec![p1])));
}

/// The first health probe the dispatcher asks for `provider`.
fn probe_due(d: &mut Dispatcher, provider: &ProviderId) -> ProbeTicket {
    std::iter::from_fn(|| d.poll_output())
        .find_map(|o| match o {
            DispatchOutput::ProbeDue { ticket, .. } if &ticket.provider_id == provider => {
                Some(ticket)
            }
            _ => None,
        })
        .expect("a probe is due")
}

#[test]
fn a_probe_answer_without_a_verdict_changes_nothing_r_cap_1() {
    // R-WD-5 makes a node-side probe error or timeout `unknown`: no
    // verdict. It neither pulls an `ok` provider nor makes an `unknown` one
    // selectable, and the overlay is not touched (R-CAP-1).
    for code in [
        Some(HealthFailureCode::TransportFailed),
        Some(HealthFailureCode::Timeout),
        Some(HealthFailureCode::MalformedResponse),
        None,
    ] {
        // Never answered before: stays unknown, not selectable (R-HT-5).
        let mut d = dispatcher();
        let g = up_unprobed(&mut d, "a");
        let p1 = ProviderId::from("p1");
        let ticket = probe_due(&mut d, &p1);
        let mut report = caps("t-p1", ProviderHealth::Unknown, 1);
        report.targets[0].failure_code = code;
        let (disposition, _) = d.probe_answer(T, &ticket, Ok((&NodeId::from("a"), g, &report)));
        assert_eq!(disposition, ProbeDisposition::Applied);
        let snapshot = d.health().provider_snapshot(&p1).unwrap();
        assert_eq!(snapshot.state, HealthState::Unknown, "{code:?}");
        assert_eq!(snapshot.failures_total, 0, "{code:?}");
        assert!(!d.admission().is_selectable(&p1), "R-HT-5");
        assert!(!d.overlay().is_lowered(&p1, g));
        // Healthy: stays healthy and selectable.
        let mut d = dispatcher();
        let g = up(&mut d, "a");
        let later = T + Duration::from_secs(30);
        d.handle_timeout(later);
        let ticket = probe_due(&mut d, &p1);
        let (disposition, _) = d.probe_answer(later, &ticket, Ok((&NodeId::from("a"), g, &report)));
        assert_eq!(disposition, ProbeDisposition::Applied);
        assert_eq!(d.health().state(&p1), Some(HealthState::Ok), "{code:?}");
        assert!(d.admission().is_selectable(&p1), "{code:?}");
    }
}

#[test]
fn a_provider_is_eligible_only_after_its_first_probe_answers_r_ht_5() {
    let mut d = dispatcher();
    let g = up_unprobed(&mut d, "a");
    let p1 = ProviderId::from("p1");
    // Unknown: the request waits in the queue.
    assert_eq!(
        d.request(T, DispatchRequest::new(1, vec![p1.clone()])),
        Admit::Queued
    );
    let ticket = probe_due(&mut d, &p1);
    let report = caps("t-p1", ProviderHealth::Available, 1);
    let (disposition, _) = d.probe_answer(T, &ticket, Ok((&NodeId::from("a"), g, &report)));
    assert_eq!(disposition, ProbeDisposition::Applied);
    let outs: Vec<_> = std::iter::from_fn(|| d.poll_output()).collect();
    assert!(
        outs.iter().any(|o| matches!(o,
            DispatchOutput::ToRequest { event: RequestEvent::Leased(l), .. }
                if l.provider_id == p1)),
        "{outs:?}"
    );
}

#[test]
fn a_provider_that_goes_stale_by_time_is_no_longer_selectable() {
    // R-HT-5: with a refresh slower than `stale_after`, an `ok` provider
    // turns `stale` by time alone (no lifecycle event); admission must
    // follow at once, as /status does.
    let mut d = dispatcher_with(HealthConfig {
        refresh_interval: Duration::from_secs(60),
        stale_after: Duration::from_secs(5),
        probe_timeout: Duration::from_secs(1),
        ..HealthConfig::default()
    });
    up(&mut d, "a");
    let p1 = ProviderId::from("p1");
    // `up` answered its first probe available at T.
    assert_eq!(d.health().state(&p1), Some(HealthState::Ok));
    assert!(d.admission().is_selectable(&p1));

    let stale_at = T + Duration::from_secs(5);
    assert!(d.poll_timeout().is_some_and(|at| at <= stale_at));
    d.handle_timeout(T + Duration::from_millis(4999));
    assert!(d.admission().is_selectable(&p1), "still fresh");
    d.handle_timeout(stale_at);
    assert_eq!(d.health().state(&p1), Some(HealthState::Stale));
    assert!(
        !d.admission().is_selectable(&p1),
        "R-HT-5: stale is never selectable"
    );
    assert_eq!(
        d.request(stale_at, DispatchRequest::new(1, vec![p1.clone()])),
        Admit::Queued
    );
}

#[test]
fn stall_recovery_readmission_avoids_the_stalled_provider() {
    let mut d = dispatcher();
    up(&mut d, "a");
    up(&mut d, "b");
    let pool = vec![ProviderId::from("p1"), ProviderId::from("p3")];
    let l = leased(d.request(T, DispatchRequest::new(1, pool.clone())));
    let stalled = l.provider_id.clone();
    let v = d.apply_terminal(
        T,
        l.lease_id,
        &l.node,
        l.generation,
        Some(&stall(ProviderHealth::Available, 1)),
    );
    assert!(matches!(v, TerminalVerdict::Applied { stall: Some(_), .. }));
    let mut again = DispatchRequest::new(1, pool);
    again.avoid_provider_id = Some(stalled.clone());
    again.allow_avoided_fallback = true;
    let l2 = leased(d.request(T, again));
    assert_ne!(l2.provider_id, stalled);
}

/// A CAPABILITIES report from node `a` about several targets at once.
fn caps_of(entries: &[(&str, ProviderHealth)], seq: u64) -> CapabilitiesReport {
    CapabilitiesReport {
        targets: entries
            .iter()
            .map(|(target, status)| TargetHealth {
                adapter: AdapterKind::Mock,
                target: (*target).into(),
                status: *status,
                failure_code: None,
                models: vec![],
            })
            .collect(),
        health_observation_seq: seq,
    }
}

/// A queued re-admission that avoids `avoid` (with the fallback flag) over
/// the pool `p1, p2`.
fn readmission(request_id: RequestId, avoid: &str) -> DispatchRequest {
    DispatchRequest {
        avoid_provider_id: Some(ProviderId::from(avoid)),
        allow_avoided_fallback: true,
        ..DispatchRequest::new(
            request_id,
            vec![ProviderId::from("p1"), ProviderId::from("p2")],
        )
    }
}

fn leases_of(d: &mut Dispatcher) -> Vec<Lease> {
    std::iter::from_fn(|| d.poll_output())
        .filter_map(|o| match o {
            DispatchOutput::ToRequest {
                event: RequestEvent::Leased(l),
                ..
            } => Some(l),
            _ => None,
        })
        .collect()
}

/// R-SEL-1 on queued re-resolution (swarm seeds 7002944, 7010104, 7011620,
/// 7014021, 7015240, 7015466, 7018728): one health probe's CAPABILITIES
/// answer raises the avoided provider's overlay *and* recovers the
/// alternate's health. The queue is served once, after both: the alternate
/// wins. (The queue used to be served between the two, so the avoided
/// provider won as "the only one eligible".)
#[test]
fn queued_readmission_takes_the_alternate_that_the_same_probe_answer_recovers() {
    let mut d = dispatcher();
    let g = up_unprobed(&mut d, "a");
    let a = NodeId::from("a");
    let (p1, p2) = (ProviderId::from("p1"), ProviderId::from("p2"));
    let outs: Vec<_> = std::iter::from_fn(|| d.poll_output()).collect();
    let ticket_of = |p: &ProviderId| {
        outs.iter()
            .find_map(|o| match o {
                DispatchOutput::ProbeDue { ticket, .. } if &ticket.provider_id == p => {
                    Some(ticket.clone())
                }
                _ => None,
            })
            .expect("readiness asks for a probe of each provider")
    };
    let p2_ticket = ticket_of(&p2);
    // p1's first probe answers available (R-HT-5: it may be leased).
    let (disposition, _) = d.probe_answer(
        T,
        &ticket_of(&p1),
        Ok((&a, g, &caps("t-p1", ProviderHealth::Available, 0))),
    );
    assert_eq!(disposition, ProbeDisposition::Applied);
    // p1 stalls with unavailable evidence (overlay lowered); p2's health
    // probe fails (tracker unavailable): nothing is eligible.
    let l = leased(d.request(T, DispatchRequest::new(1, vec![p1.clone()])));
    d.apply_terminal(
        T,
        l.lease_id,
        &a,
        g,
        Some(&stall(ProviderHealth::Unavailable, 1)),
    );
    let (disposition, _) = d.probe_answer(T, &p2_ticket, Err(HealthFailureCode::TransportFailed));
    assert_eq!(disposition, ProbeDisposition::Applied);
    assert!(!d.admission().is_selectable(&p1) && !d.admission().is_selectable(&p2));
    // p2's recovery probe is due; the stalled request waits in the queue.
    let retry_at = d
        .health()
        .provider_snapshot(&p2)
        .and_then(|s| s.next_retry_at)
        .expect("a failing provider has a retry moment");
    d.handle_timeout(retry_at);
    let retry = probe_due(&mut d, &p2);
    assert_eq!(d.request(retry_at, readmission(1, "p1")), Admit::Queued);
    assert!(leases_of(&mut d).is_empty());
    // The node reports both targets available.
    let report = caps_of(
        &[
            ("t-p1", ProviderHealth::Available),
            ("t-p2", ProviderHealth::Available),
        ],
        2,
    );
    let (_, verdicts) = d.probe_answer(retry_at, &retry, Ok((&a, g, &report)));
    assert_eq!(
        verdicts[0].recovery,
        RecoveryOutcome::Recovered,
        "p1 raised"
    );
    assert!(d.admission().is_selectable(&p1) && d.admission().is_selectable(&p2));
    let leases = leases_of(&mut d);
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].request_id, 1);
    assert_eq!(leases[0].provider_id, p2, "R-SEL-1: the alternate, not p1");
}

/// R-SEL-1 (swarm seeds 7008954, 7015093): one CAPABILITIES answer raises
/// two lowered providers; the avoided one is listed first. The queue is
/// served after the whole answer.
#[test]
fn queued_readmission_takes_the_alternate_raised_by_the_same_capabilities_answer() {
    let mut d = dispatcher();
    let g = up(&mut d, "a");
    let a = NodeId::from("a");
    let (p1, p2) = (ProviderId::from("p1"), ProviderId::from("p2"));
    // Lower both by fresh unavailable stall evidence.
    let l1 = leased(d.request(T, DispatchRequest::new(1, vec![p1.clone()])));
    let l2 = leased(d.request(T, DispatchRequest::new(2, vec![p2.clone()])));
    d.apply_terminal(
        T,
        l1.lease_id,
        &a,
        g,
        Some(&stall(ProviderHealth::Unavailable, 1)),
    );
    d.apply_terminal(
        T,
        l2.lease_id,
        &a,
        g,
        Some(&stall(ProviderHealth::Unavailable, 2)),
    );
    assert!(d.overlay().is_lowered(&p1, g) && d.overlay().is_lowered(&p2, g));
    assert_eq!(d.request(T, readmission(1, "p1")), Admit::Queued);
    assert!(leases_of(&mut d).is_empty());
    let report = caps_of(
        &[
            ("t-p1", ProviderHealth::Available),
            ("t-p2", ProviderHealth::Available),
        ],
        3,
    );
    let verdicts = d.apply_capabilities(T, &a, g, &report);
    assert!(
        verdicts
            .iter()
            .all(|v| v.recovery == RecoveryOutcome::Recovered)
    );
    let leases = leases_of(&mut d);
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].provider_id, p2, "R-SEL-1: the alternate, not p1");
}

/// R-OVL-2 with R-HT-5: a stall terminal frees its lease and lowers its
/// provider in one input; a request waiting for that provider is not handed
/// the capacity the terminal freed (it used to be, a moment before the
/// lowering).
#[test]
fn capacity_freed_by_an_unavailable_stall_terminal_does_not_go_to_its_provider() {
    let mut d = dispatcher();
    let g = up(&mut d, "a");
    let a = NodeId::from("a");
    let p1 = ProviderId::from("p1");
    let l = leased(d.request(T, DispatchRequest::new(1, vec![p1.clone()])));
    assert_eq!(
        d.request(T, DispatchRequest::new(2, vec![p1.clone()])),
        Admit::Queued,
        "p1 has capacity 1"
    );
    d.apply_terminal(
        T,
        l.lease_id,
        &a,
        g,
        Some(&stall(ProviderHealth::Unavailable, 1)),
    );
    assert!(leases_of(&mut d).is_empty(), "p1 is lowered");
    assert!(d.admission().is_queued(2));
    // A success terminal frees capacity and the queue is served.
    let report = caps("t-p1", ProviderHealth::Available, 2);
    d.apply_capabilities(T, &a, g, &report);
    let leases = leases_of(&mut d);
    assert_eq!(leases.len(), 1);
    assert_eq!((leases[0].request_id, &leases[0].provider_id), (2, &p1));
}

// ---------------------------------------------------------------------------
// Property test: long random sequences against the composed dispatcher.
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Connect(u8),
    Ready(u8, bool),
    Disconnect(u8, bool),
    Request {
        pool: u8,
        avoid: Option<u8>,
        allow: bool,
    },
    PreSend(u8),
    Terminal {
        lease: u8,
        reception: u8,
        failure: FailureChoice,
    },
    Cancel(u8),
    Capabilities {
        node: u8,
        stale_gen: bool,
        provider: u8,
        status: u8,
        seq_delta: i8,
        dup: bool,
    },
    /// Answer one of the health probes the dispatcher asked for (or
    /// answer one again).
    ProbeAnswer {
        probe: u8,
        answer: ProbeChoice,
    },
    Advance(u16),
}

#[derive(Debug, Clone, Copy)]
enum FailureChoice {
    None,
    Error,
    Stall { health: u8, seq_delta: i8 },
}

/// How a health probe's CAPABILITIES command came back.
#[derive(Debug, Clone, Copy)]
enum ProbeChoice {
    /// The command failed before any report (transport, timeout, ...).
    Failed(u8),
    /// A report: one entry for the probed target with `status`, or
    /// (`shape` 1) only an entry about another target, or (`shape` 2) the
    /// probed target listed twice.
    Report {
        status: u8,
        shape: u8,
        seq_delta: i8,
    },
}

/// Failure codes a probe command can end with.
const PROBE_FAILURES: [HealthFailureCode; 3] = [
    HealthFailureCode::TransportFailed,
    HealthFailureCode::Timeout,
    HealthFailureCode::MalformedResponse,
];

/// A health profile short enough for probes, probe timeouts, backoff and
/// recovery probes to happen within one generated sequence. With
/// `stale_prone` the regular refresh is slower than `stale_after`, so `ok`
/// providers also go `stale` by time alone (R-HT-5).
fn property_health(stale_prone: bool) -> HealthConfig {
    let config = HealthConfig {
        refresh_interval: Duration::from_millis(2000),
        backoff_base: Duration::from_millis(250),
        backoff_cap: Duration::from_millis(2000),
        stale_after: Duration::from_millis(6000),
        probe_timeout: Duration::from_millis(1000),
    };
    if stale_prone {
        // Short enough that an `ok` result ages out within a few time steps.
        HealthConfig {
            refresh_interval: Duration::from_millis(1000),
            backoff_base: Duration::from_millis(50),
            backoff_cap: Duration::from_millis(400),
            stale_after: Duration::from_millis(300),
            probe_timeout: Duration::from_millis(200),
        }
    } else {
        config
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0u8..2).prop_map(Op::Connect),
        2 => (0u8..2, any::<bool>()).prop_map(|(n, s)| Op::Ready(n, s)),
        1 => (0u8..2, any::<bool>()).prop_map(|(n, s)| Op::Disconnect(n, s)),
        5 => (0u8..3, proptest::option::of(0u8..3), any::<bool>())
            .prop_map(|(pool, avoid, allow)| Op::Request { pool, avoid, allow }),
        3 => any::<u8>().prop_map(Op::PreSend),
        5 => (any::<u8>(), 0u8..4, prop_oneof![
                Just(FailureChoice::None),
                Just(FailureChoice::Error),
                (0u8..3, -2i8..3).prop_map(|(health, seq_delta)| FailureChoice::Stall { health, seq_delta }),
            ])
            .prop_map(|(lease, reception, failure)| Op::Terminal { lease, reception, failure }),
        1 => any::<u8>().prop_map(Op::Cancel),
        // Mostly current-generation answers, half of them `available`, so
        // recoveries (and their interplay with health) happen often.
        2 => (0u8..2, prop::bool::weighted(0.25), 0u8..3, prop_oneof![3 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)], -2i8..3, prop::bool::weighted(0.1))
            .prop_map(|(node, stale_gen, provider, status, seq_delta, dup)| Op::Capabilities {
                node, stale_gen, provider, status, seq_delta, dup
            }),
        3 => (any::<u8>(), prop_oneof![
                1 => (0u8..3).prop_map(ProbeChoice::Failed),
                3 => (0u8..3, prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)], -2i8..3)
                    .prop_map(|(status, shape, seq_delta)| ProbeChoice::Report { status, shape, seq_delta }),
            ])
            .prop_map(|(probe, answer)| Op::ProbeAnswer { probe, answer }),
        1 => (1u16..400).prop_map(Op::Advance),
    ]
}

const NODES: [&str; 2] = ["a", "b"];
const PROVIDERS: [&str; 3] = ["p1", "p2", "p3"];

fn health_of(i: u8) -> ProviderHealth {
    ProviderHealth::ALL[usize::from(i) % 3]
}

/// The model the properties are checked against.
#[derive(Default)]
struct Model {
    /// The dispatcher's health profile.
    health: HealthConfig,
    now_ms: u64,
    /// Every generation each node ever got, in order.
    generations: BTreeMap<usize, Vec<Generation>>,
    /// Every lease ever granted.
    granted: Vec<Lease>,
    /// Leases released (by any path), with how many times.
    released: BTreeMap<LeaseId, u32>,
    /// Requests that got their one terminal at the dispatcher level.
    request_ids: u64,
    /// Last observation sequence applied per (provider, generation).
    last_seq: BTreeMap<(String, Generation), u64>,
    /// Per node, the next sequence the (simulated) Session would hand out.
    next_seq: BTreeMap<(usize, Generation), u64>,
    /// Health probes the dispatcher asked for, oldest first (bounded).
    probes: Vec<ProbeCall>,
    /// Each node's current generation and whether it completed readiness,
    /// kept from the inputs alone (R-GEN-1, R-GEN-2).
    current: BTreeMap<usize, (Generation, bool)>,
    /// The overlay as the rules say it must be: (provider, generation)
    /// lowered by fresh unavailable evidence, not yet raised (R-OVL-2,
    /// R-CAP-1).
    lowered: BTreeSet<(String, Generation)>,
    /// Every request asked for, by id (R-SEL-1 on leases from the queue).
    requests: BTreeMap<RequestId, DispatchRequest>,
}

/// The most probes the model remembers; later ones time out unanswered.
const PROBES_REMEMBERED: usize = 64;

/// One [`DispatchOutput::ProbeDue`] and whether it was answered.
#[derive(Debug, Clone)]
struct ProbeCall {
    ticket: ProbeTicket,
    node: usize,
    /// The ready generation the probe goes to.
    generation: Generation,
    issued_ms: u64,
    answered: bool,
}

/// What the tracker remembers of one provider, apart from its schedule.
fn health_record(d: &Dispatcher, p: &ProviderId) -> Option<(HealthState, u32, u64, u64)> {
    d.health().provider_snapshot(p).map(|s| {
        (
            s.state,
            s.consecutive_failures,
            s.successes_total,
            s.failures_total,
        )
    })
}

impl Model {
    fn release(&mut self, lease_id: LeaseId) -> Result<(), TestCaseError> {
        let n = self.released.entry(lease_id).or_default();
        *n += 1;
        prop_assert_eq!(*n, 1, "lease {} released more than once", lease_id);
        Ok(())
    }

    /// The node's current generation, from the model (not the registry).
    fn current_gen(&self, node: usize) -> Option<Generation> {
        self.current.get(&node).map(|(g, _)| *g)
    }

    /// Current and ready, from the model.
    fn dispatchable(&self, node: &NodeId, generation: Generation) -> bool {
        NODES
            .iter()
            .position(|n| *n == node.as_str())
            .and_then(|i| self.current.get(&i))
            == Some(&(generation, true))
    }

    fn seq(&mut self, node: usize, generation: Generation, delta: i8) -> u64 {
        let next = self.next_seq.entry((node, generation)).or_insert(1);
        let value = (*next as i64 + i64::from(delta)).max(0) as u64;
        if delta >= 0 {
            *next = value + 1;
        }
        value
    }
}

fn check_outputs(d: &mut Dispatcher, m: &mut Model) -> Result<(), TestCaseError> {
    loop {
        let mut unroutable = Vec::new();
        while let Some(out) = d.poll_output() {
            match out {
                DispatchOutput::ToRequest {
                    event: RequestEvent::Leased(lease),
                    ..
                } => {
                    prop_assert!(
                        m.dispatchable(&lease.node, lease.generation),
                        "leased on a non-dispatchable generation: {:?} view {:?}",
                        lease,
                        d.registry().view(&lease.node)
                    );
                    // R-SEL-1 on queued re-resolution too: judged on the
                    // state after the whole input.
                    let req = m
                        .requests
                        .get(&lease.request_id)
                        .cloned()
                        .ok_or_else(|| TestCaseError::fail("lease for an unknown request"))?;
                    check_avoid_rule(d, m, &req, &lease)?;
                    m.granted.push(lease);
                }
                DispatchOutput::ToRequest {
                    event: RequestEvent::LeaseFenced(lease),
                    ..
                } => m.release(lease.lease_id)?,
                DispatchOutput::ProbeDue {
                    ticket,
                    node,
                    generation,
                } => {
                    let spec = d.admission().provider(&ticket.provider_id).cloned();
                    prop_assert_eq!(spec.map(|s| s.node), Some(node.clone()));
                    if let Some(g) = generation {
                        prop_assert!(
                            d.registry().is_dispatchable(&node, g),
                            "a probe is due on a generation that is not current and ready"
                        );
                    }
                    let node = NODES
                        .iter()
                        .position(|n| *n == node.as_str())
                        .ok_or_else(|| TestCaseError::fail("probe of an unknown node"))?;
                    match generation {
                        // The driver answers a transport failure at once.
                        None => unroutable.push(ticket),
                        Some(generation) if m.probes.len() < PROBES_REMEMBERED => {
                            m.probes.push(ProbeCall {
                                ticket,
                                node,
                                generation,
                                issued_ms: m.now_ms,
                                answered: false,
                            });
                        }
                        Some(_) => {}
                    }
                }
                _ => {}
            }
        }
        if unroutable.is_empty() {
            return Ok(());
        }
        let now = Instant::from_millis(m.now_ms);
        for ticket in unroutable {
            let (disposition, verdicts) =
                d.probe_answer(now, &ticket, Err(HealthFailureCode::TransportFailed));
            prop_assert_eq!(disposition, ProbeDisposition::Applied);
            prop_assert!(verdicts.is_empty());
            prop_assert_eq!(
                d.health().state(&ticket.provider_id),
                Some(HealthState::Unavailable)
            );
        }
    }
}

/// R-CAP-1 for one CAPABILITIES report from (`node`, `g`), against the
/// model: nothing is lowered; a provider is raised exactly when the model
/// has it lowered in `g`, `g` is current, the answer is unambiguous (one
/// entry) about exactly its target, `available`, and strictly newer than
/// the last sequence applied; each verdict is the one the model expects.
fn check_capabilities_effect(
    d: &Dispatcher,
    m: &mut Model,
    (node, g): (usize, Generation),
    report: &CapabilitiesReport,
    before: &[bool],
    verdicts: &[CapabilityVerdict],
) -> Result<(), TestCaseError> {
    let current = m.current_gen(node) == Some(g);
    let ambiguous = report.targets.len() > 1;
    let seq = report.health_observation_seq;
    let mut expected_verdicts = Vec::new();
    for (i, p) in PROVIDERS.iter().enumerate() {
        let key = (p.to_string(), g);
        let after = d.overlay().is_lowered(&ProviderId::from(*p), g);
        if current {
            prop_assert_eq!(before[i], m.lowered.contains(&key), "overlay before");
        }
        let about_it = current
            && !ambiguous
            && d.admission()
                .provider(&ProviderId::from(*p))
                .is_some_and(|s| s.node.as_str() == NODES[node])
            && report.targets[0].target == format!("t-{p}");
        if !about_it {
            prop_assert_eq!(after, before[i], "{} changed by an answer not about it", p);
            continue;
        }
        let status = report.targets[0].status;
        let fresh = m.last_seq.get(&key).is_none_or(|last| seq > *last);
        let expected = if !fresh {
            RecoveryOutcome::Stale
        } else if status != ProviderHealth::Available {
            RecoveryOutcome::NotAvailable
        } else if !m.lowered.contains(&key) {
            RecoveryOutcome::NotLowered
        } else {
            RecoveryOutcome::Recovered
        };
        if expected == RecoveryOutcome::Recovered {
            m.lowered.remove(&key);
        }
        // Every fresh `available` is applied, with or without a provider
        // to raise: it moves the freshness mark (R-OVL-2).
        if matches!(
            expected,
            RecoveryOutcome::Recovered | RecoveryOutcome::NotLowered
        ) {
            m.last_seq.insert(key, seq);
        }
        prop_assert_eq!(
            after,
            before[i] && expected != RecoveryOutcome::Recovered,
            "{} lowered={} after {:?}",
            p,
            after,
            expected
        );
        expected_verdicts.push((ProviderId::from(*p), status, expected));
    }
    let actual: Vec<_> = verdicts
        .iter()
        .map(|v| (v.provider_id.clone(), v.health, v.recovery))
        .collect();
    prop_assert_eq!(actual, expected_verdicts);
    Ok(())
}

fn lowered_overlay(d: &Dispatcher, g: Generation) -> Vec<bool> {
    PROVIDERS
        .iter()
        .map(|p| d.overlay().is_lowered(&ProviderId::from(*p), g))
        .collect()
}

/// Answer probe `which` (R-HT-1..5, R-CAP-1): only the probed provider's
/// health changes; a first answer within the probe timeout is applied and
/// a repeated one is not; the result is what the report says about the
/// probed target; an unavailable provider is out of selection.
fn answer_probe(
    d: &mut Dispatcher,
    m: &mut Model,
    which: u8,
    answer: ProbeChoice,
) -> Result<(), TestCaseError> {
    if m.probes.is_empty() {
        return Ok(());
    }
    let now = Instant::from_millis(m.now_ms);
    let i = usize::from(which) % m.probes.len();
    let call = m.probes[i].clone();
    m.probes[i].answered = true;
    let provider = call.ticket.provider_id.clone();
    let others: Vec<_> = PROVIDERS
        .iter()
        .map(|p| ProviderId::from(*p))
        .filter(|p| *p != provider)
        .map(|p| (health_record(d, &p), p))
        .collect();
    let timeout_ms = crate::time::duration_ms(m.health.probe_timeout);
    let in_time = m.now_ms < call.issued_ms + timeout_ms;
    let prior = d.health().provider_snapshot(&provider);
    let g = call.generation;
    let (disposition, expected) = match answer {
        ProbeChoice::Failed(code) => {
            let code = PROBE_FAILURES[usize::from(code) % PROBE_FAILURES.len()];
            let (disposition, verdicts) = d.probe_answer(now, &call.ticket, Err(code));
            prop_assert!(verdicts.is_empty());
            (disposition, ProbeResult::Failure(code))
        }
        ProbeChoice::Report {
            status,
            shape,
            seq_delta,
        } => {
            let pid = provider.as_str().to_owned();
            let status = health_of(status);
            let seq = m.seq(call.node, g, seq_delta);
            let (target, dup, expected) = match shape {
                0 => (
                    format!("t-{pid}"),
                    false,
                    match status {
                        ProviderHealth::Available => ProbeResult::Success,
                        ProviderHealth::Unavailable => {
                            ProbeResult::Failure(HealthFailureCode::ProviderRejected)
                        }
                        ProviderHealth::Unknown => {
                            ProbeResult::NoVerdict(HealthFailureCode::Timeout)
                        }
                    },
                ),
                1 => (
                    "t-elsewhere".to_owned(),
                    false,
                    ProbeResult::Failure(HealthFailureCode::OwnershipMismatch),
                ),
                _ => (
                    format!("t-{pid}"),
                    true,
                    ProbeResult::Failure(HealthFailureCode::MalformedResponse),
                ),
            };
            let mut report = caps(&target, status, seq);
            if dup {
                report.targets.push(report.targets[0].clone());
            }
            let before = lowered_overlay(d, g);
            let (disposition, verdicts) = d.probe_answer(
                now,
                &call.ticket,
                Ok((&NodeId::from(NODES[call.node]), g, &report)),
            );
            check_capabilities_effect(d, m, (call.node, g), &report, &before, &verdicts)?;
            (disposition, expected)
        }
    };
    for (record, p) in &others {
        prop_assert_eq!(
            &health_record(d, p),
            record,
            "R-HT-1: probing {} changed {}",
            provider,
            p
        );
    }
    if call.answered {
        prop_assert_eq!(
            disposition,
            ProbeDisposition::Stale,
            "a probe applied twice"
        );
    } else if in_time {
        prop_assert_eq!(disposition, ProbeDisposition::Applied);
    }
    if disposition == ProbeDisposition::Applied {
        let snapshot = d
            .health()
            .provider_snapshot(&provider)
            .ok_or_else(|| TestCaseError::fail("probed provider is not followed"))?;
        match expected {
            ProbeResult::Success => {
                prop_assert_eq!(snapshot.state, HealthState::Ok);
                prop_assert_eq!(snapshot.consecutive_failures, 0);
            }
            ProbeResult::NoVerdict(_) => {
                // R-CAP-1: no verdict changes nothing.
                let prior = prior.ok_or_else(|| TestCaseError::fail("not followed before"))?;
                prop_assert_eq!(snapshot.state, prior.state);
                prop_assert_eq!(snapshot.consecutive_failures, prior.consecutive_failures);
                prop_assert_eq!(snapshot.failure_code, prior.failure_code);
                prop_assert_eq!(snapshot.failures_total, prior.failures_total);
            }
            ProbeResult::Failure(code) => {
                prop_assert_eq!(snapshot.state, HealthState::Unavailable);
                prop_assert_eq!(snapshot.failure_code, Some(code));
                prop_assert!(
                    snapshot.next_retry_at.is_some_and(|at| at > now),
                    "R-HT-3: a failure backs off"
                );
                prop_assert!(
                    !d.admission().is_selectable(&provider),
                    "R-HT-5: an unavailable provider stays selectable"
                );
            }
        }
    }
    Ok(())
}

fn check_invariants(d: &Dispatcher, m: &Model) -> Result<(), TestCaseError> {
    d.admission()
        .check_invariants()
        .map_err(TestCaseError::fail)?;
    // Held leases are exactly the granted, unreleased ones.
    let held: BTreeSet<LeaseId> = m
        .granted
        .iter()
        .map(|l| l.lease_id)
        .filter(|id| d.admission().lease(*id).is_some())
        .collect();
    let unreleased: BTreeSet<LeaseId> = m
        .granted
        .iter()
        .map(|l| l.lease_id)
        .filter(|id| !m.released.contains_key(id))
        .collect();
    prop_assert_eq!(held, unreleased, "leak or phantom lease");
    prop_assert_eq!(
        d.admission().leases_in_use(),
        m.granted.len() - m.released.len()
    );
    // Every held lease is bound to its node's current, ready generation,
    // or is about to be fenced (never: fences are applied in the same input).
    for l in m
        .granted
        .iter()
        .filter(|l| !m.released.contains_key(&l.lease_id))
    {
        prop_assert!(
            d.registry().is_dispatchable(&l.node, l.generation),
            "a held lease outlived its generation"
        );
    }
    // Generations only increase.
    for gens in m.generations.values() {
        prop_assert!(gens.windows(2).all(|w| w[0] < w[1]));
    }
    // The registry agrees with the model of generations (R-GEN-1/2).
    for (i, node) in NODES.iter().enumerate() {
        let n = NodeId::from(*node);
        prop_assert_eq!(d.registry().view(&n).generation, m.current_gen(i));
        for g in m.generations.get(&i).into_iter().flatten() {
            prop_assert_eq!(
                d.registry().is_dispatchable(&n, *g),
                m.dispatchable(&n, *g),
                "dispatchable {} generation {}",
                node,
                g
            );
        }
    }
    // The overlay is exactly the model's in each node's current generation
    // (R-OVL-2, R-CAP-1; it is scoped to its generation), and selectable is
    // exactly the model's eligibility.
    for (i, node) in NODES.iter().enumerate() {
        for g in m.current_gen(i).iter() {
            for p in PROVIDERS {
                let pid = ProviderId::from(p);
                if d.admission().provider(&pid).map(|s| s.node.as_str()) != Some(*node) {
                    continue;
                }
                prop_assert_eq!(
                    d.overlay().is_lowered(&pid, *g),
                    m.lowered.contains(&(p.to_string(), *g)),
                    "overlay of {} in generation {}",
                    p,
                    g
                );
            }
        }
    }
    for p in PROVIDERS {
        let pid = ProviderId::from(p);
        prop_assert_eq!(
            d.admission().is_selectable(&pid),
            eligible_in_model(d, m, &pid),
            "{} selectable",
            p
        );
    }
    check_queue_is_served(d, m)?;
    // R-HT-5 and R-OVL-2 together: a provider that is unavailable or
    // stale, or lowered in its online generation, is never selectable.
    for view in d.admission().capacity_view() {
        let p = &view.provider_id;
        let unhealthy = matches!(
            d.health().state(p),
            Some(HealthState::Unavailable | HealthState::Stale)
        );
        let lowered = view.online.is_some_and(|g| d.overlay().is_lowered(p, g));
        prop_assert!(
            !(d.admission().is_selectable(p) && (unhealthy || lowered)),
            "{} is selectable while {:?} and lowered={}",
            p,
            d.health().state(p),
            lowered
        );
    }
    Ok(())
}

/// Whether `p` may be selected, from the model's facts: its node's
/// generation is current and ready, the model has not lowered it there,
/// and its health is neither unavailable nor stale (R-GEN-2, R-OVL-2,
/// R-HT-5).
fn eligible_in_model(d: &Dispatcher, m: &Model, p: &ProviderId) -> bool {
    let Some(spec) = d.admission().provider(p) else {
        return false;
    };
    let Some(node) = NODES.iter().position(|n| *n == spec.node.as_str()) else {
        return false;
    };
    let Some(&(g, true)) = m.current.get(&node) else {
        return false;
    };
    !m.lowered.contains(&(p.to_string(), g)) && d.health().state(p) == Some(HealthState::Ok)
}

/// R-SEL-1 for one lease (granted at once or from the queue): the avoided
/// provider only with the flag and only when no alternate of the pool is
/// eligible.
fn check_avoid_rule(
    d: &Dispatcher,
    m: &Model,
    req: &DispatchRequest,
    lease: &Lease,
) -> Result<(), TestCaseError> {
    prop_assert!(
        req.pool.contains(&lease.provider_id),
        "leased outside the pool"
    );
    prop_assert!(
        eligible_in_model(d, m, &lease.provider_id),
        "leased an ineligible provider {}",
        lease.provider_id
    );
    if req.avoid_provider_id.as_ref() == Some(&lease.provider_id) {
        prop_assert!(
            req.allow_avoided_fallback,
            "avoided provider chosen without the flag"
        );
        let alternate = req
            .pool
            .iter()
            .filter(|p| Some(*p) != req.avoid_provider_id.as_ref())
            .find(|p| eligible_in_model(d, m, p));
        prop_assert!(
            alternate.is_none(),
            "avoided provider chosen while {:?} is eligible",
            alternate
        );
    }
    Ok(())
}

/// The other side of R-SEL-1: no queued request could be served (an
/// eligible alternate with room, or the flagged avoided provider with room
/// when no alternate is eligible).
fn check_queue_is_served(d: &Dispatcher, m: &Model) -> Result<(), TestCaseError> {
    let room = |p: &ProviderId| {
        d.admission()
            .capacity_view()
            .iter()
            .any(|c| &c.provider_id == p && c.in_use < c.capacity)
    };
    for r in d.admission().queued_requests() {
        let avoided = r.avoid_provider_id.as_ref();
        let alternates: Vec<&ProviderId> = r
            .pool
            .iter()
            .filter(|p| Some(*p) != avoided && eligible_in_model(d, m, p))
            .collect();
        let servable = alternates.iter().find(|p| room(p));
        prop_assert!(
            servable.is_none(),
            "request {} queued while {:?} is eligible with room",
            r.request_id,
            servable
        );
        if let Some(p) = avoided {
            prop_assert!(
                !(alternates.is_empty()
                    && r.allow_avoided_fallback
                    && r.pool.contains(p)
                    && eligible_in_model(d, m, p)
                    && room(p)),
                "request {} queued while its flagged avoided {} is the only eligible one, with room",
                r.request_id,
                p
            );
        }
    }
    Ok(())
}

fn run_ops(ops: Vec<Op>, stale_prone: bool) -> Result<(), TestCaseError> {
    let health = property_health(stale_prone);
    let mut d = dispatcher_with(health);
    let mut m = Model {
        health,
        ..Model::default()
    };
    for op in ops {
        let now = Instant::from_millis(m.now_ms);
        match op {
            Op::Connect(n) => {
                let node = usize::from(n);
                let (g, _) = d
                    .register(now, &NodeId::from(NODES[node]), &register_req())
                    .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
                m.generations.entry(node).or_default().push(g);
                m.current.insert(node, (g, false));
            }
            Op::Ready(n, stale) => {
                let node = usize::from(n);
                let gens = m.generations.get(&node).cloned().unwrap_or_default();
                let g = if stale { gens.first() } else { gens.last() };
                if let Some(&g) = g {
                    let accepted = d.ready(now, &NodeId::from(NODES[node]), g);
                    // R-GEN-2: only the current generation completes
                    // readiness (the model's, kept from the inputs).
                    let expected = m.current_gen(node) == Some(g);
                    prop_assert_eq!(accepted, expected);
                    if expected {
                        m.current.insert(node, (g, true));
                    }
                }
            }
            Op::Disconnect(n, stale) => {
                let node = usize::from(n);
                let gens = m.generations.get(&node).cloned().unwrap_or_default();
                let g = if stale { gens.first() } else { gens.last() };
                if let Some(&g) = g {
                    d.connection_closed(
                        now,
                        &NodeId::from(NODES[node]),
                        g,
                        CloseCode::HeartbeatTimeout,
                    );
                    if m.current_gen(node) == Some(g) {
                        m.current.remove(&node);
                    }
                }
            }
            Op::Request { pool, avoid, allow } => {
                m.request_ids += 1;
                let pool: Vec<ProviderId> = match pool {
                    0 => all_pool(),
                    1 => vec![ProviderId::from("p1"), ProviderId::from("p3")],
                    _ => vec![ProviderId::from("p2")],
                };
                let req = DispatchRequest {
                    request_id: m.request_ids,
                    pool,
                    avoid_provider_id: avoid.map(|i| ProviderId::from(PROVIDERS[usize::from(i)])),
                    allow_avoided_fallback: allow,
                    stall_timeout_ms: None,
                };
                m.requests.insert(req.request_id, req.clone());
                if let Admit::Leased(lease) = d.request(now, req.clone()) {
                    prop_assert!(m.dispatchable(&lease.node, lease.generation));
                    check_avoid_rule(&d, &m, &req, &lease)?;
                    m.granted.push(lease);
                }
            }
            Op::PreSend(i) => {
                if let Some(lease) = m
                    .granted
                    .get(usize::from(i) % m.granted.len().max(1))
                    .cloned()
                {
                    match d.pre_send(now, lease.lease_id) {
                        PreSend::Send(l) => prop_assert!(
                            m.dispatchable(&l.node, l.generation),
                            "pre-send passed a non-current generation"
                        ),
                        PreSend::Refenced => m.release(lease.lease_id)?,
                        PreSend::UnknownLease => {
                            prop_assert!(m.released.contains_key(&lease.lease_id))
                        }
                    }
                }
            }
            Op::Terminal {
                lease,
                reception,
                failure,
            } => {
                let Some(lease) = m
                    .granted
                    .get(usize::from(lease) % m.granted.len().max(1))
                    .cloned()
                else {
                    continue;
                };
                // Reception: the lease's own connection, the other node's
                // current one, or an older generation of the lease's node.
                let lease_node = NODES
                    .iter()
                    .position(|n| *n == lease.node.as_str())
                    .unwrap_or(0);
                let (rnode, rgen) = match reception {
                    0 | 1 => (lease_node, lease.generation),
                    2 => {
                        let other = 1 - lease_node;
                        (other, m.current_gen(other).unwrap_or(1))
                    }
                    _ => (lease_node, m.generations[&lease_node][0]),
                };
                let fail = match failure {
                    FailureChoice::None => None,
                    FailureChoice::Error => Some(ExecutionFailure::new(FailureCode::ProviderError)),
                    FailureChoice::Stall { health, seq_delta } => {
                        Some(stall(health_of(health), m.seq(rnode, rgen, seq_delta)))
                    }
                };
                let was_lowered = d.overlay().is_lowered(&lease.provider_id, lease.generation);
                let verdict = d.apply_terminal(
                    now,
                    lease.lease_id,
                    &NodeId::from(NODES[rnode]),
                    rgen,
                    fail.as_ref(),
                );
                match verdict {
                    TerminalVerdict::Applied {
                        lease: l,
                        stall,
                        evidence,
                    } => {
                        prop_assert_eq!(&l, &lease);
                        prop_assert_eq!(
                            rgen,
                            lease.generation,
                            "applied from a foreign generation"
                        );
                        prop_assert_eq!(NODES[rnode], lease.node.as_str());
                        m.release(l.lease_id)?;
                        let is_stall = matches!(failure, FailureChoice::Stall { .. });
                        prop_assert_eq!(
                            stall.is_some(),
                            is_stall,
                            "R-OVL-1: exactly the valid stalls are handed off"
                        );
                        prop_assert_eq!(evidence.is_some(), is_stall);
                        if let (Some(f), Some(outcome)) = (fail.as_ref(), evidence) {
                            // R-OVL-2, both ways: fresh unavailable evidence
                            // lowers, fresh other evidence is recorded,
                            // anything not strictly newer is stale.
                            let key = (l.provider_id.to_string(), l.generation);
                            let seq = f.health_observation_seq.unwrap_or(0);
                            let fresh = m.last_seq.get(&key).is_none_or(|last| seq > *last);
                            let expected = match (fresh, f.provider_health) {
                                (false, _) => EvidenceOutcome::Stale,
                                (true, Some(ProviderHealth::Unavailable)) => {
                                    EvidenceOutcome::Lowered
                                }
                                (true, _) => EvidenceOutcome::Recorded,
                            };
                            prop_assert_eq!(outcome, expected, "evidence seq {} of {:?}", seq, key);
                            if fresh {
                                m.last_seq.insert(key.clone(), seq);
                            }
                            if expected == EvidenceOutcome::Lowered {
                                m.lowered.insert(key);
                            }
                        }
                    }
                    TerminalVerdict::Ignored(_) => {
                        prop_assert_eq!(
                            was_lowered,
                            d.overlay().is_lowered(&lease.provider_id, lease.generation),
                            "an ignored terminal changed the overlay"
                        );
                    }
                }
            }
            Op::Cancel(i) => {
                let id = u64::from(i) % m.request_ids.max(1) + 1;
                if let Some(lease) = d.cancel(now, id) {
                    prop_assert_eq!(lease.request_id, id);
                    m.release(lease.lease_id)?;
                }
            }
            Op::Capabilities {
                node,
                stale_gen,
                provider,
                status,
                seq_delta,
                dup,
            } => {
                let node = usize::from(node);
                let Some(gens) = m.generations.get(&node).cloned() else {
                    continue;
                };
                let g = if stale_gen {
                    gens[0]
                } else {
                    *gens.last().unwrap_or(&gens[0])
                };
                let pid = PROVIDERS[usize::from(provider)];
                let seq = m.seq(node, g, seq_delta);
                let status = health_of(status);
                let mut report = caps(&format!("t-{pid}"), status, seq);
                if dup {
                    report.targets.push(report.targets[0].clone());
                }
                let before = lowered_overlay(&d, g);
                let verdicts = d.apply_capabilities(now, &NodeId::from(NODES[node]), g, &report);
                check_capabilities_effect(&d, &mut m, (node, g), &report, &before, &verdicts)?;
            }
            Op::ProbeAnswer { probe, answer } => answer_probe(&mut d, &mut m, probe, answer)?,
            Op::Advance(ms) => {
                m.now_ms += u64::from(ms);
                d.handle_timeout(Instant::from_millis(m.now_ms));
            }
        }
        check_outputs(&mut d, &mut m)?;
        check_invariants(&d, &m)?;
    }
    // Quiesce: every node goes away; nothing may stay leased.
    for (node, gens) in m.generations.clone() {
        if let Some(&g) = gens.last() {
            d.connection_closed(
                Instant::from_millis(m.now_ms),
                &NodeId::from(NODES[node]),
                g,
                CloseCode::Normal,
            );
            m.current.remove(&node);
        }
        check_outputs(&mut d, &mut m)?;
    }
    check_invariants(&d, &m)?;
    prop_assert_eq!(
        d.admission().leases_in_use(),
        0,
        "leases leaked after every node left"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Capacity never leaks or goes negative; each lease is released exactly
    /// once; nothing is dispatched to a non-current or not-ready generation;
    /// the overlay is lowered only by fresh unavailable evidence and raised
    /// only by a strictly newer available with exactly one match; an avoided
    /// provider is chosen only as R-SEL-1 allows. Health probes are answered
    /// (or left to time out): each changes only its own provider's health,
    /// applies once, and an unavailable or stale provider is never
    /// selectable (R-HT-1, R-HT-3, R-HT-5), also when it went stale by
    /// time alone (`stale_prone` health profile).
    #[test]
    fn dispatcher_rules_hold_over_random_sequences(
        ops in proptest::collection::vec(op(), 1..120),
        stale_prone in any::<bool>(),
    ) {
        run_ops(ops, stale_prone)?;
    }
}

#[test]
fn terminal_verdicts_become_the_gates_attempt_events() {
    // R-LEASE-1, R-GATE-2: only an applied terminal ends an attempt with its
    // own outcome; an ignored one means the transport is gone.
    let mut d = dispatcher();
    up(&mut d, "a");
    let lease = leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    let applied = |stall| TerminalVerdict::Applied {
        lease: lease.clone(),
        stall,
        evidence: None,
    };
    assert_eq!(applied(None).attempt_event(None), AttemptEvent::Completed);
    assert_eq!(
        applied(None).attempt_event(Some(FailureCode::ProviderError)),
        AttemptEvent::Failed {
            code: FailureCode::ProviderError
        }
    );
    let confirmed = ConfirmedStall {
        provider_id: ProviderId::from("p1"),
        health: ProviderHealth::Unknown,
    };
    assert_eq!(
        applied(Some(confirmed.clone())).attempt_event(Some(FailureCode::ResponseStalled)),
        AttemptEvent::Stalled(confirmed)
    );
    for ignored in [
        IgnoredTerminal::NotHeld,
        IgnoredTerminal::FencedGeneration,
        IgnoredTerminal::Mismatch,
    ] {
        assert_eq!(
            TerminalVerdict::Ignored(ignored).attempt_event(None),
            AttemptEvent::TransportLost
        );
    }
}

fn parked(generation: u64, run_id: u64, target: &str) -> iop_wire::ParkedRun {
    iop_wire::ParkedRun {
        key: iop_wire::RunKey { generation, run_id },
        response_id: format!("resp_{run_id}"),
        adapter: AdapterKind::Mock,
        target: target.into(),
        first_kept_frame: 1,
        last_frame: 4,
        ended: false,
    }
}

fn drain_outputs(d: &mut Dispatcher) -> Vec<DispatchOutput> {
    std::iter::from_fn(|| d.poll_output()).collect()
}

#[test]
fn a_parked_run_holds_the_provider_of_its_own_node_adapter_and_target_r_park_2() {
    // Node a has p1 (capacity 1) and p2; its run is p2's: p1 stays free.
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let mut req = register_req();
    req.parked = vec![parked(90, 7, "t-p2")];
    let (g, _) = d.register(T, &a, &req).unwrap();
    assert!(d.ready(T, &a, g));
    answer_first_probes(&mut d, "a", g);
    let outs = drain_outputs(&mut d);
    let held: Vec<ProviderId> = outs
        .iter()
        .filter_map(|o| match o {
            DispatchOutput::ParkedRuns { runs, .. } => Some(
                runs.iter()
                    .map(|r| r.provider_id.clone())
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(held, vec![ProviderId::from("p2")], "{outs:?}");
    leased(d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])));
    // Node b reports a run for a's target: not a's provider's to hold.
    let b = NodeId::from("b");
    let mut req = register_req();
    req.parked = vec![parked(91, 8, "t-p2")];
    let (gb, _) = d.register(T, &b, &req).unwrap();
    assert!(d.ready(T, &b, gb));
    assert_eq!(d.admission().holds(), 1, "only a's run is held");
}

/// R-LIM-4, R-PARK-2: a report that names one run many times is offered
/// once (each offer costs the custody a store read).
#[test]
fn a_run_named_many_times_in_one_report_is_offered_once() {
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let mut req = register_req();
    req.parked = vec![parked(90, 7, "t-p2"); 500];
    req.parked.push(parked(90, 8, "t-p2"));
    let (g, _) = d.register(T, &a, &req).unwrap();
    assert!(d.ready(T, &a, g));
    answer_first_probes(&mut d, "a", g);
    let offered: usize = drain_outputs(&mut d)
        .iter()
        .map(|o| match o {
            DispatchOutput::ParkedRuns { runs, .. } => runs.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(offered, 2);
}

#[test]
fn r_park_2_a_registration_names_the_runs_its_node_keeps_after_the_old_generation_is_fenced() {
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let (g1, _) = d.register(T, &a, &register_req()).unwrap();
    drain_outputs(&mut d);
    let mut req = register_req();
    req.parked = vec![
        parked(g1, 7, "t-p1"),
        parked(g1, 7, "t-p1"),
        parked(g1, 8, "t-unknown"),
    ];
    let (g2, _) = d.register(T, &a, &req).unwrap();
    let outs = drain_outputs(&mut d);
    let fenced = outs
        .iter()
        .position(|o| matches!(o, DispatchOutput::Fenced { generation, .. } if *generation == g1))
        .expect("the earlier generation is fenced");
    let (at, kept) = outs
        .iter()
        .enumerate()
        .find_map(|(i, o)| match o {
            DispatchOutput::KeptRuns(kept) => Some((i, kept.clone())),
            _ => None,
        })
        .expect("the report is heard");
    assert!(fenced < at, "a lease's fence comes first: {outs:?}");
    assert_eq!((kept.node.clone(), kept.generation), (a.clone(), g2));
    let key = |run_id| iop_wire::RunKey {
        generation: g1,
        run_id,
    };
    // Every run named, whatever its provider (one the Edge does not know
    // is still the node's run), and only those.
    assert!(kept.keeps(key(7), "resp_7") && kept.keeps(key(8), "resp_8"));
    assert!(
        !kept.keeps(key(7), "resp_8"),
        "the same key of another response"
    );
    assert!(!kept.keeps(key(9), "resp_9"));
    // A report at the wire bound may have left runs out: it says nothing.
    let mut full = register_req();
    full.parked = (0..iop_wire::MAX_PARKED_RUNS as u64)
        .map(|i| parked(g2, i, "t-p1"))
        .collect();
    d.register(T, &a, &full).unwrap();
    assert!(
        !drain_outputs(&mut d)
            .iter()
            .any(|o| matches!(o, DispatchOutput::KeptRuns(_)))
    );
}

#[test]
fn r_park_2_a_reported_parked_run_holds_its_capacity_and_is_offered_at_readiness() {
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let mut req = register_req();
    req.parked = vec![parked(90, 7, "t-p1"), parked(90, 8, "t-unknown")];
    let (g, _) = d.register(T, &a, &req).unwrap();
    drain_outputs(&mut d);
    // p1 (capacity 1) is held for the parked run before any request can
    // take it at readiness.
    d.handle_input(
        T,
        DispatchInput::Request(RequestCommand::Admit(DispatchRequest::new(
            1,
            vec![ProviderId::from("p1")],
        ))),
    );
    d.handle_input(
        T,
        DispatchInput::Ready {
            node: a.clone(),
            generation: g,
        },
    );
    let outs = drain_outputs(&mut d);
    let offered: Vec<_> = outs
        .iter()
        .filter_map(|o| match o {
            DispatchOutput::ParkedRuns {
                runs, generation, ..
            } if *generation == g => Some(runs.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(
        offered.len(),
        1,
        "only the run of a known provider: {outs:?}"
    );
    assert_eq!(offered[0].provider_id, ProviderId::from("p1"));
    assert!(
        !outs.iter().any(|o| matches!(
            o,
            DispatchOutput::ToRequest {
                event: RequestEvent::Leased(_),
                ..
            }
        )),
        "the queued request does not take the held capacity"
    );
    // The request that writes its response adopts it: the hold becomes
    // its lease on the new generation.
    d.handle_input(
        T,
        DispatchInput::Request(RequestCommand::Adopt {
            request_id: 2,
            node: offered[0].node.clone(),
            key: offered[0].run.key,
        }),
    );
    let outs = drain_outputs(&mut d);
    let lease = outs
        .iter()
        .find_map(|o| match o {
            DispatchOutput::ToRequest {
                request_id: 2,
                event: RequestEvent::Leased(l),
            } => Some(l.clone()),
            _ => None,
        })
        .expect("adopted");
    assert_eq!((lease.provider_id.as_str(), lease.generation), ("p1", g));
    assert!(d.admission().check_invariants().is_ok());
    // A second adoption of the same run finds no hold.
    d.handle_input(
        T,
        DispatchInput::Request(RequestCommand::Adopt {
            request_id: 3,
            node: offered[0].node.clone(),
            key: offered[0].run.key,
        }),
    );
    assert!(drain_outputs(&mut d).iter().any(|o| matches!(
        o,
        DispatchOutput::ToRequest {
            request_id: 3,
            event: RequestEvent::Rejected(_)
        }
    )));
}

#[test]
fn r_park_2_a_hold_nobody_adopts_is_let_go_and_the_queue_moves() {
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let mut req = register_req();
    req.parked = vec![parked(90, 7, "t-p1")];
    let (g, _) = d.register(T, &a, &req).unwrap();
    d.handle_input(
        T,
        DispatchInput::Ready {
            node: a.clone(),
            generation: g,
        },
    );
    answer_first_probes(&mut d, "a", g);
    drain_outputs(&mut d);
    assert_eq!(
        d.request(T, DispatchRequest::new(1, vec![ProviderId::from("p1")])),
        Admit::Queued,
        "held"
    );
    d.handle_input(
        T,
        DispatchInput::ReleaseParked {
            node: a.clone(),
            key: iop_wire::RunKey {
                generation: 90,
                run_id: 7,
            },
        },
    );
    assert!(drain_outputs(&mut d).iter().any(|o| matches!(
        o,
        DispatchOutput::ToRequest {
            request_id: 1,
            event: RequestEvent::Leased(_)
        }
    )));
    // A hold also ends with its generation, or when it expires.
    let mut d = dispatcher();
    let (g, _) = d.register(T, &a, &req).unwrap();
    assert_eq!(d.admission().holds(), 1);
    d.handle_input(
        T,
        DispatchInput::ConnectionClosed {
            node: a.clone(),
            generation: g,
            reason: CloseCode::Normal,
        },
    );
    assert_eq!(d.admission().holds(), 0);
    let (_g, _) = d.register(T, &a, &req).unwrap();
    assert_eq!(d.admission().holds(), 1);
    d.handle_timeout(T.saturating_add(PARKED_HOLD));
    assert_eq!(d.admission().holds(), 0);
    assert!(d.admission().check_invariants().is_ok());
}

#[test]
fn r_park_2_runs_parked_later_are_offered_on_a_ready_connection_only() {
    let mut d = dispatcher();
    let a = NodeId::from("a");
    let (g, _) = d.register(T, &a, &register_req()).unwrap();
    // Not ready yet: nothing is held or offered.
    d.handle_input(
        T,
        DispatchInput::Parked {
            node: a.clone(),
            generation: g,
            runs: vec![parked(90, 7, "t-p2")],
        },
    );
    assert_eq!(d.admission().holds(), 0);
    assert!(d.ready(T, &a, g));
    drain_outputs(&mut d);
    d.handle_input(
        T,
        DispatchInput::Parked {
            node: a.clone(),
            generation: g,
            runs: vec![parked(90, 7, "t-p2")],
        },
    );
    assert_eq!(d.admission().holds(), 1);
    assert!(drain_outputs(&mut d).iter().any(|o| matches!(
        o,
        DispatchOutput::ParkedRuns { runs, .. } if runs.len() == 1
    )));
}
