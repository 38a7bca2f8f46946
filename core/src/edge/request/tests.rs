//! The request machine, step by step with a manual clock.

use std::time::Duration;

use iop_wire::{
    AdapterKind, ExecutionFailure, FailureCode, FinishReason, ProviderHealth, ProviderTunnelFrame,
    RunEventKind, Usage,
};

use super::*;
use crate::edge::admission::{AdmitRejection, Lease, PreSend};
use crate::edge::dispatch::{RequestCommand, RequestEvent, TerminalVerdict};
use crate::edge::gate::{AdmissionFailure, ConfirmedStall, GateBudget, GateFailure};
use crate::ids::{NodeId, ProviderId};
use crate::tenant::TokenUse;
use crate::time::Instant;

const RID: u64 = 7;

fn t(ms: u64) -> Instant {
    Instant::ZERO.saturating_add(Duration::from_millis(ms))
}

fn spec(tunnel_api: Option<TunnelApi>, tunnel_providers: &[&str]) -> RequestSpec {
    RequestSpec {
        request_id: RID,
        pool: vec![ProviderId::from("p0"), ProviderId::from("p1")],
        budget: GateBudget::new(3, Duration::from_secs(10)).unwrap(),
        tunnel_api,
        tunnel_providers: tunnel_providers
            .iter()
            .map(|p| ProviderId::from(*p))
            .collect(),
        journal: None,
        park_grace_ms: 0,
        continuation: false,
        prompt_tokens: 0,
    }
}

/// A pool of one provider: a failed attempt has nowhere to fail over to.
fn single(mut spec: RequestSpec) -> RequestSpec {
    spec.pool.truncate(1);
    spec
}

fn lease(id: u64, provider: &str, adapter: AdapterKind) -> Lease {
    Lease {
        lease_id: id,
        request_id: RID,
        provider_id: ProviderId::from(provider),
        adapter,
        target: "m".into(),
        node: NodeId::from("n0"),
        generation: 3,
        run_id: 100 + id,
        stall_timeout_ms: 0,
    }
}

/// Every output; a further attempt's reservation (R-TEN-2) is answered
/// "reserved" at once, as for a request no tenant limits (the `r_ten_2_*`
/// tests answer it themselves, with [`drain_outputs`]).
fn drain(r: &mut Request) -> Vec<RequestOutput> {
    let mut outs = Vec::new();
    while let Some(out) = r.poll_output() {
        let reserve = matches!(out, RequestOutput::ReserveAttempt { .. });
        outs.push(out);
        if reserve {
            r.handle_input(Instant::ZERO, RequestInput::AttemptReserved);
        }
    }
    outs
}

/// Every output, as it is.
fn drain_outputs(r: &mut Request) -> Vec<RequestOutput> {
    std::iter::from_fn(|| r.poll_output()).collect()
}

fn deliveries(outs: &[RequestOutput]) -> Vec<Delivery> {
    outs.iter()
        .filter_map(|o| match o {
            RequestOutput::Deliver(d) => Some(d.clone()),
            _ => None,
        })
        .collect()
}

fn commands(outs: &[RequestOutput]) -> Vec<RequestCommand> {
    outs.iter()
        .filter_map(|o| match o {
            RequestOutput::Dispatch(c) => Some(c.clone()),
            _ => None,
        })
        .collect()
}

fn cancel() -> RequestCommand {
    RequestCommand::Cancel { request_id: RID }
}

fn applied(l: &Lease) -> TerminalVerdict {
    TerminalVerdict::Applied {
        lease: l.clone(),
        stall: None,
        evidence: None,
    }
}

/// Drive a new request to a running attempt on `l`; returns the outputs
/// of the pre-send answer.
fn running(r: &mut Request, l: &Lease) -> Vec<RequestOutput> {
    drain(r);
    r.handle_input(
        t(0),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    assert_eq!(
        commands(&drain(r)),
        vec![RequestCommand::PreSend {
            request_id: RID,
            lease_id: l.lease_id
        }]
    );
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    let outs = drain(r);
    r.handle_input(t(1), RequestInput::Opened);
    assert!(drain(r).is_empty());
    // The attempt starts observed, then opens.
    assert!(matches!(
        outs.first(),
        Some(RequestOutput::Observe(RequestObservation::AttemptStarted { attempt, .. }))
            if *attempt == r.gate().attempts()
    ));
    outs.into_iter()
        .filter(|o| !matches!(o, RequestOutput::Observe(_)))
        .collect()
}

/// Lease `l` to a new request and pass its pre-send fence: the attempt's
/// stream is being opened.
fn opening(r: &mut Request, l: &Lease) {
    r.handle_input(
        t(0),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
}

/// The attempt ended as a lost transport.
fn lost_transport(outs: &[RequestOutput]) -> bool {
    outs.contains(&RequestOutput::Observe(RequestObservation::AttemptEnded {
        failure: Some(FailureCode::TransportClosed),
    }))
}

/// An admission went out.
fn admits(outs: &[RequestOutput]) -> bool {
    commands(outs)
        .iter()
        .any(|c| matches!(c, RequestCommand::Admit(_)))
}

fn observations(outs: &[RequestOutput]) -> Vec<RequestObservation> {
    outs.iter()
        .filter_map(|o| match o {
            RequestOutput::Observe(obs) => Some(obs.clone()),
            _ => None,
        })
        .collect()
}

fn run(kind: RunEventKind) -> RequestInput {
    RequestInput::Frame(NodeFrame::Run(kind))
}

fn completed() -> RunEventKind {
    RunEventKind::Completed {
        finish_reason: FinishReason::Stop,
        usage: Some(Usage::tokens(3, 2)),
    }
}

#[test]
fn first_admission_has_zero_hints_r_sel_1() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let outs = drain(&mut r);
    assert_eq!(
        commands(&outs),
        vec![RequestCommand::Admit(DispatchRequest {
            request_id: RID,
            pool: vec![ProviderId::from("p0"), ProviderId::from("p1")],
            avoid_provider_id: None,
            allow_avoided_fallback: false,
            stall_timeout_ms: None,
        })]
    );
}

#[test]
fn happy_path_commits_on_first_content_and_finishes_once_r_gate_2() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    let outs = running(&mut r, &l);
    // R-WD-7: the node gets what is left of the budget as its deadline.
    assert_eq!(
        outs,
        vec![RequestOutput::Open {
            lease: l.clone(),
            tunnel: false,
            deadline_ms: 9_999,
            adopt: None,
            continuation: None,
        }]
    );
    r.handle_input(
        t(2),
        run(RunEventKind::Started {
            session_id: "s".into(),
        }),
    );
    assert!(
        deliveries(&drain(&mut r)).is_empty(),
        "a start never commits"
    );
    r.handle_input(t(3), run(RunEventKind::Usage(Usage::default())));
    assert!(deliveries(&drain(&mut r)).is_empty(), "usage is held");
    r.handle_input(t(4), run(RunEventKind::TextDelta("hi".into())));
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::Observe(RequestObservation::Committed)));
    assert_eq!(
        deliveries(&outs),
        vec![
            Delivery::Commit { tunnel_head: None },
            Delivery::Event(RunEventKind::Usage(Usage::default())),
            Delivery::Event(RunEventKind::TextDelta("hi".into())),
        ]
    );
    r.handle_input(t(5), run(RunEventKind::TextDelta("!".into())));
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![Delivery::Event(RunEventKind::TextDelta("!".into()))]
    );
    r.handle_input(t(6), run(completed()));
    assert_eq!(
        commands(&drain(&mut r)),
        vec![RequestCommand::Terminal {
            request_id: RID,
            lease_id: 1,
            node: NodeId::from("n0"),
            generation: 3,
            failure: None,
        }]
    );
    r.handle_input(
        t(7),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(&l),
        }),
    );
    let outs = drain(&mut r);
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Event(completed()), Delivery::Finish]
    );
    assert_eq!(commands(&outs), vec![cancel()]);
    assert!(r.is_ended());
    assert_eq!(r.poll_timeout(), None);
    // Nothing after the end.
    r.handle_input(t(8), run(RunEventKind::TextDelta("late".into())));
    assert!(drain(&mut r).is_empty());
}

#[test]
fn the_phase_an_operator_sees_follows_the_request_from_queue_to_end() {
    let mut r = Request::new(t(0), spec(None, &[]));
    assert_eq!(r.phase(), RequestPhase::Queued, "its admission is out");
    drain(&mut r);
    r.handle_input(t(0), RequestInput::Dispatch(RequestEvent::Queued));
    drain(&mut r);
    assert_eq!(r.phase(), RequestPhase::Queued);
    let l = lease(1, "p0", AdapterKind::Mock);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    drain(&mut r);
    assert_eq!(
        r.phase(),
        RequestPhase::Sending,
        "its pre-send fence is out"
    );
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    drain(&mut r);
    assert_eq!(
        r.phase(),
        RequestPhase::Sending,
        "its stream is being opened"
    );
    r.handle_input(t(1), RequestInput::Opened);
    assert_eq!(r.phase(), RequestPhase::Running);
    r.handle_input(t(2), run(RunEventKind::TextDelta("hi".into())));
    drain(&mut r);
    assert_eq!(r.phase(), RequestPhase::Running, "committed, still running");
    r.handle_input(t(3), run(completed()));
    drain(&mut r);
    assert_eq!(r.phase(), RequestPhase::Settling, "its verdict is awaited");
    r.handle_input(
        t(4),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(&l),
        }),
    );
    drain(&mut r);
    assert_eq!(r.phase(), RequestPhase::Ended);
    let names: Vec<&str> = [
        RequestPhase::Queued,
        RequestPhase::Sending,
        RequestPhase::Running,
        RequestPhase::Parked,
        RequestPhase::Settling,
        RequestPhase::Ended,
    ]
    .iter()
    .map(|p| p.as_str())
    .collect();
    assert_eq!(
        names,
        [
            "queued", "sending", "running", "parked", "settling", "ended"
        ]
    );
}

#[test]
fn an_answer_without_content_still_commits_once() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(6), run(completed()));
    drain(&mut r);
    r.handle_input(
        t(7),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(&l),
        }),
    );
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![
            Delivery::Commit { tunnel_head: None },
            Delivery::Event(completed()),
            Delivery::Finish
        ]
    );
}

#[test]
fn admission_refusals_map_to_their_failures() {
    for (why, failure) in [
        (AdmitRejection::QueueFull, AdmissionFailure::QueueFull),
        (
            AdmitRejection::NoRoute,
            AdmissionFailure::NoEligibleProvider,
        ),
        (
            AdmitRejection::DuplicateRequest,
            AdmissionFailure::NoEligibleProvider,
        ),
    ] {
        let mut r = Request::new(t(0), spec(None, &[]));
        drain(&mut r);
        r.handle_input(t(1), RequestInput::Dispatch(RequestEvent::Rejected(why)));
        let outs = drain(&mut r);
        assert_eq!(
            deliveries(&outs),
            vec![Delivery::Fail {
                kind: GateFailure::Admission(failure),
                in_stream: false,
                provider: None,
            }]
        );
        assert_eq!(commands(&outs), vec![cancel()]);
        assert!(r.is_ended());
    }
}

#[test]
fn queue_expiry_is_a_queue_timeout() {
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    r.handle_input(t(1), RequestInput::Dispatch(RequestEvent::Queued));
    assert!(drain(&mut r).is_empty());
    r.handle_input(t(2), RequestInput::Dispatch(RequestEvent::QueueExpired));
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![Delivery::Fail {
            kind: GateFailure::Admission(AdmissionFailure::QueueTimeout),
            in_stream: false,
            provider: None,
        }]
    );
}

#[test]
fn a_stale_pre_send_fence_waits_for_the_re_resolved_lease_r_gen_4() {
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    let first = lease(1, "p0", AdapterKind::Mock);
    r.handle_input(t(1), RequestInput::Dispatch(RequestEvent::Leased(first)));
    drain(&mut r);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Refenced)),
    );
    assert!(drain(&mut r).is_empty(), "no second admission");
    let second = lease(2, "p1", AdapterKind::Mock);
    r.handle_input(t(3), RequestInput::Dispatch(RequestEvent::Leased(second)));
    assert_eq!(
        commands(&drain(&mut r)),
        vec![RequestCommand::PreSend {
            request_id: RID,
            lease_id: 2
        }]
    );
    assert_eq!(r.gate().attempts(), 0, "nothing was dispatched yet");
}

#[test]
fn an_unknown_lease_at_the_fence_lets_go_and_admits_again() {
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Leased(lease(1, "p0", AdapterKind::Mock))),
    );
    drain(&mut r);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::UnknownLease)),
    );
    let cmds = commands(&drain(&mut r));
    assert_eq!(cmds.len(), 2);
    assert_eq!(cmds[0], cancel());
    assert!(matches!(cmds[1], RequestCommand::Admit(_)));
}

#[test]
fn a_fence_while_queued_or_pre_sending_never_admits_twice() {
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    r.handle_input(t(1), RequestInput::Dispatch(RequestEvent::Queued));
    let l = lease(1, "p0", AdapterKind::Mock);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    assert!(drain(&mut r).is_empty());
    r.handle_input(
        t(3),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    drain(&mut r);
    r.handle_input(
        t(4),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    assert!(drain(&mut r).is_empty(), "the pre-send answer says it");
}

#[test]
fn a_fence_of_the_running_attempt_is_one_transport_terminal_r_gen_3() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(RunEventKind::TextDelta("a".into())));
    drain(&mut r);
    r.handle_input(t(3), RequestInput::Dispatch(RequestEvent::LeaseFenced(l)));
    let outs = drain(&mut r);
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::TransportClosed),
            in_stream: true,
            provider: None,
        }]
    );
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert!(r.is_ended());
}

#[test]
fn a_confirmed_stall_before_commit_readmits_with_the_avoid_hint_r_gate_2() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    let mut failure = ExecutionFailure::new(FailureCode::ResponseStalled);
    failure.provider_health = Some(ProviderHealth::Available);
    // The canceled provider call returned within the grace (R-WD-4).
    failure.retryable = true;
    r.handle_input(t(2), run(RunEventKind::Failed(failure.clone())));
    assert_eq!(
        commands(&drain(&mut r)),
        vec![RequestCommand::Terminal {
            request_id: RID,
            lease_id: 1,
            node: NodeId::from("n0"),
            generation: 3,
            failure: Some(failure),
        }]
    );
    r.handle_input(
        t(3),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: 1,
            verdict: TerminalVerdict::Applied {
                lease: l.clone(),
                stall: Some(ConfirmedStall {
                    provider_id: l.provider_id.clone(),
                    health: ProviderHealth::Available,
                }),
                evidence: None,
            },
        }),
    );
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert!(outs.contains(&RequestOutput::Observe(RequestObservation::Readmitted)));
    let admit = commands(&outs)
        .into_iter()
        .find_map(|c| match c {
            RequestCommand::Admit(d) => Some(d),
            _ => None,
        })
        .expect("re-admitted");
    assert_eq!(admit.avoid_provider_id, Some(ProviderId::from("p0")));
    assert!(admit.allow_avoided_fallback);
    assert!(deliveries(&outs).is_empty());
    // The second attempt runs and completes.
    let second = lease(2, "p1", AdapterKind::Mock);
    running(&mut r, &second);
    assert_eq!(r.gate().attempts(), 2);
}

/// A confirmed stall before commit, `retryable` as the node marked it:
/// what the request outputs after the dispatcher's verdict.
fn stall_verdict(retryable: bool) -> (Request, Vec<RequestOutput>) {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    let mut failure = ExecutionFailure::new(FailureCode::ResponseStalled);
    failure.provider_health = Some(ProviderHealth::Available);
    failure.retryable = retryable;
    r.handle_input(t(2), run(RunEventKind::Failed(failure)));
    drain(&mut r);
    r.handle_input(
        t(3),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: 1,
            verdict: TerminalVerdict::Applied {
                lease: l.clone(),
                stall: Some(ConfirmedStall {
                    provider_id: l.provider_id.clone(),
                    health: ProviderHealth::Available,
                }),
                evidence: None,
            },
        }),
    );
    let outs = drain(&mut r);
    (r, outs)
}

#[test]
fn a_stall_the_node_did_not_mark_retryable_is_never_readmitted_r_fail_1() {
    // Found by the simulator's R-FAIL-1 invariant: a confirmed stall was
    // re-admitted whatever its mark, so a provider call that may still be
    // running (it did not return within the close grace, R-WD-4) got a
    // second attempt on another provider.
    let (r, outs) = stall_verdict(false);
    assert!(
        !commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_))),
        "{outs:?}"
    );
    assert!(!outs.contains(&RequestOutput::Observe(RequestObservation::Readmitted)));
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::ResponseStalled),
            in_stream: false,
            provider: None,
        }]
    );
    assert!(r.is_ended());
    // The same stall marked retryable is re-admitted (R-GATE-2).
    let (r, outs) = stall_verdict(true);
    assert!(outs.contains(&RequestOutput::Observe(RequestObservation::Readmitted)));
    assert!(!r.is_ended());
}

#[test]
fn a_providers_error_ends_the_request_with_what_the_provider_said_r_gate_3() {
    for (status, message) in [
        (Some(400), Some("Input should be 'text' or 'json_object'")),
        (Some(500), None),
    ] {
        let mut r = Request::new(t(0), spec(None, &[]));
        let l = lease(1, "p0", AdapterKind::Mock);
        running(&mut r, &l);
        let mut failure = ExecutionFailure::new(FailureCode::ProviderError);
        failure.http_status = status;
        failure.provider_message = message.map(str::to_owned);
        r.handle_input(t(2), run(RunEventKind::Failed(failure)));
        // The dispatcher (and its trace) gets the failure's class only.
        let terminal = commands(&drain(&mut r))
            .into_iter()
            .find_map(|c| match c {
                RequestCommand::Terminal { failure, .. } => failure,
                _ => None,
            })
            .expect("the terminal goes to the dispatcher");
        assert_eq!(terminal.http_status, status);
        assert_eq!(terminal.provider_message, None);
        r.handle_input(
            t(3),
            RequestInput::Dispatch(RequestEvent::Terminal {
                lease_id: 1,
                verdict: applied(&l),
            }),
        );
        assert_eq!(
            deliveries(&drain(&mut r)),
            vec![Delivery::Fail {
                kind: GateFailure::Attempt(FailureCode::ProviderError),
                in_stream: false,
                provider: Some(ProviderSaid {
                    http_status: status,
                    message: message.map(str::to_owned),
                }),
            }]
        );
        assert!(r.is_ended());
    }
}

#[cfg(feature = "planted-bugs")]
#[test]
fn planted_readmit_unretryable_stall_readmits_a_stall_without_the_mark() {
    use crate::planted::PlantedBug;
    let mut r = Request::new(t(0), spec(None, &[]));
    r.plant(PlantedBug::ReadmitUnretryableStall);
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    let failure = ExecutionFailure::new(FailureCode::ResponseStalled);
    assert!(!failure.retryable);
    r.handle_input(t(2), run(RunEventKind::Failed(failure)));
    drain(&mut r);
    r.handle_input(
        t(3),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: 1,
            verdict: TerminalVerdict::Applied {
                lease: l.clone(),
                stall: Some(ConfirmedStall {
                    provider_id: l.provider_id.clone(),
                    health: ProviderHealth::Unknown,
                }),
                evidence: None,
            },
        }),
    );
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::Observe(RequestObservation::Readmitted)));
}

#[test]
fn an_ignored_terminal_is_a_lost_transport_r_lease_1() {
    let mut r = Request::new(t(0), single(spec(None, &[])));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(completed()));
    drain(&mut r);
    r.handle_input(
        t(3),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: 9,
            verdict: TerminalVerdict::Ignored(crate::edge::dispatch::IgnoredTerminal::NotHeld),
        }),
    );
    assert!(
        drain(&mut r).is_empty(),
        "a verdict about another lease changes nothing"
    );
    r.handle_input(
        t(3),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: 1,
            verdict: TerminalVerdict::Ignored(
                crate::edge::dispatch::IgnoredTerminal::FencedGeneration,
            ),
        }),
    );
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::TransportClosed),
            in_stream: false,
            provider: None,
        }]
    );
}

#[test]
fn the_tunnel_choice_needs_a_tunnel_provider_that_speaks_the_api() {
    let cases = [
        (
            Some(TunnelApi::OpenAi),
            &["p0"][..],
            AdapterKind::OpenAi,
            true,
        ),
        (
            Some(TunnelApi::OpenAi),
            &["p0"][..],
            AdapterKind::Mock,
            true,
        ),
        (
            Some(TunnelApi::OpenAi),
            &["p0"][..],
            AdapterKind::Ollama,
            false,
        ),
        (
            Some(TunnelApi::Ollama),
            &["p0"][..],
            AdapterKind::Ollama,
            true,
        ),
        (
            Some(TunnelApi::OpenAi),
            &["p1"][..],
            AdapterKind::OpenAi,
            false,
        ),
        (None, &["p0"][..], AdapterKind::OpenAi, false),
    ];
    for (api, providers, adapter, tunnel) in cases {
        let mut r = Request::new(t(0), spec(api, providers));
        let outs = running(&mut r, &lease(1, "p0", adapter));
        assert!(
            matches!(&outs[..], [RequestOutput::Open { tunnel: got, .. }] if *got == tunnel),
            "{api:?} {providers:?} {adapter:?}: {outs:?}"
        );
    }
}

#[test]
fn a_tunnel_commits_on_body_bytes_with_its_own_head() {
    let mut r = Request::new(t(0), spec(Some(TunnelApi::OpenAi), &["p0"]));
    let l = lease(1, "p0", AdapterKind::OpenAi);
    running(&mut r, &l);
    let headers = vec![("content-type".to_owned(), "text/event-stream".to_owned())];
    r.handle_input(
        t(2),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Head {
            status: 200,
            headers: headers.clone(),
        })),
    );
    assert!(deliveries(&drain(&mut r)).is_empty());
    r.handle_input(
        t(3),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Body(vec![]))),
    );
    assert!(
        deliveries(&drain(&mut r)).is_empty(),
        "empty body: no commit"
    );
    r.handle_input(
        t(4),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Body(b"x".to_vec()))),
    );
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![
            Delivery::Commit {
                tunnel_head: Some((200, headers))
            },
            Delivery::Body(vec![]),
            Delivery::Body(b"x".to_vec()),
        ]
    );
}

#[test]
fn a_second_tunnel_head_fails_the_attempt_r_lim_3() {
    let mut r = Request::new(t(0), spec(Some(TunnelApi::OpenAi), &["p0"]));
    running(&mut r, &lease(1, "p0", AdapterKind::OpenAi));
    let head = || {
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Head {
            status: 200,
            headers: vec![],
        }))
    };
    r.handle_input(t(2), head());
    drain(&mut r);
    r.handle_input(t(3), head());
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::MalformedResponse),
            in_stream: false,
            provider: None,
        }]
    );
}

#[test]
fn a_frame_of_the_wrong_kind_fails_the_attempt() {
    let mut r = Request::new(t(0), spec(None, &[]));
    running(&mut r, &lease(1, "p0", AdapterKind::Mock));
    r.handle_input(
        t(2),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::End)),
    );
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::MalformedResponse),
            in_stream: false,
            provider: None,
        }]
    );
}

#[test]
fn the_pre_commit_buffer_is_bounded_in_items() {
    let mut r = Request::new(t(0), spec(None, &[]));
    running(&mut r, &lease(1, "p0", AdapterKind::Mock));
    for _ in 0..MAX_HELD_DELIVERIES {
        r.handle_input(t(2), run(RunEventKind::Usage(Usage::default())));
        assert!(deliveries(&drain(&mut r)).is_empty());
    }
    assert!(r.held_bytes() <= MAX_HELD_BYTES);
    r.handle_input(t(3), run(RunEventKind::Usage(Usage::default())));
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::MalformedResponse),
            in_stream: false,
            provider: None,
        }]
    );
    assert_eq!(r.held_bytes(), 0);
}

#[test]
fn the_pre_commit_buffer_is_bounded_in_decoded_bytes() {
    let mut r = Request::new(t(0), spec(Some(TunnelApi::OpenAi), &["p0"]));
    running(&mut r, &lease(1, "p0", AdapterKind::OpenAi));
    let big = vec![("x".repeat(200_000), "y".repeat(200_000))];
    r.handle_input(
        t(2),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Head {
            status: 200,
            headers: [big.clone(), big.clone(), big].concat(),
        })),
    );
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::MalformedResponse),
            in_stream: false,
            provider: None,
        }]
    );
}

#[test]
fn open_failures_are_attempt_events_r_gate_1() {
    for (failure, code) in [
        (OpenFailure::Unencodable, FailureCode::InvalidRequest),
        (OpenFailure::Transport, FailureCode::TransportClosed),
        (OpenFailure::NoConnection, FailureCode::TransportClosed),
    ] {
        let mut r = Request::new(t(0), single(spec(None, &[])));
        drain(&mut r);
        let l = lease(1, "p0", AdapterKind::Mock);
        opening(&mut r, &l);
        drain(&mut r);
        r.handle_input(t(2), RequestInput::OpenFailed(failure));
        let outs = drain(&mut r);
        assert_eq!(commands(&outs)[0], cancel(), "the lease goes first");
        assert_eq!(
            deliveries(&outs),
            vec![Delivery::Fail {
                kind: GateFailure::Attempt(code),
                in_stream: false,
                provider: None,
            }]
        );
        assert_eq!(r.gate().attempts(), 1, "the open counted as the attempt");
    }
}

#[test]
fn a_client_disconnect_cancels_the_run_and_sends_nothing_r_gate_4() {
    let mut r = Request::new(t(0), spec(None, &[]));
    running(&mut r, &lease(1, "p0", AdapterKind::Mock));
    r.handle_input(t(2), RequestInput::ClientDisconnected);
    let outs = drain(&mut r);
    assert!(deliveries(&outs).is_empty());
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert_eq!(commands(&outs), vec![cancel()]);
    assert!(r.is_ended());
}

#[test]
fn the_budget_deadline_ends_the_request_r_gate_3() {
    let mut r = Request::new(t(0), spec(None, &[]));
    running(&mut r, &lease(1, "p0", AdapterKind::Mock));
    assert_eq!(r.poll_timeout(), Some(t(10_000)));
    r.handle_timeout(t(9_999));
    assert!(drain(&mut r).is_empty(), "nothing fires early");
    r.handle_timeout(t(10_000));
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Fail {
            kind: GateFailure::BudgetExpired,
            in_stream: false,
            provider: None,
        }]
    );
    assert_eq!(commands(&outs), vec![cancel()]);
}

#[test]
fn a_stream_that_ends_without_a_terminal_is_a_lost_transport() {
    let mut r = Request::new(t(0), single(spec(None, &[])));
    running(&mut r, &lease(1, "p0", AdapterKind::Mock));
    r.handle_input(t(2), RequestInput::StreamEnded);
    let outs = drain(&mut r);
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::TransportClosed),
            in_stream: false,
            provider: None,
        }]
    );
}

#[test]
fn every_wait_and_attempt_is_observed_once_with_its_outcome() {
    let mut r = Request::new(t(0), single(spec(None, &[])));
    assert_eq!(
        observations(&drain(&mut r)),
        vec![RequestObservation::Admitting]
    );
    let l = lease(1, "p0", AdapterKind::Mock);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    assert_eq!(
        observations(&drain(&mut r)),
        vec![RequestObservation::Leased {
            provider_id: ProviderId::from("p0")
        }]
    );
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    r.handle_input(t(1), RequestInput::Opened);
    drain(&mut r);
    // A lost transport ends the attempt with its code, then the request.
    r.handle_input(t(2), RequestInput::StreamEnded);
    assert_eq!(
        observations(&drain(&mut r)),
        vec![
            RequestObservation::AttemptEnded {
                failure: Some(FailureCode::TransportClosed)
            },
            RequestObservation::Ended { attempts: 1 },
        ]
    );
    // A client that leaves mid-attempt ends it as canceled.
    let mut r = Request::new(t(0), single(spec(None, &[])));
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::ClientDisconnected);
    assert_eq!(
        observations(&drain(&mut r)),
        vec![
            RequestObservation::AttemptEnded {
                failure: Some(FailureCode::Canceled)
            },
            RequestObservation::Ended { attempts: 1 },
        ]
    );
    // A refused admission ends the wait, not an attempt.
    let mut r = Request::new(t(0), single(spec(None, &[])));
    drain(&mut r);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Rejected(AdmitRejection::QueueFull)),
    );
    assert_eq!(
        observations(&drain(&mut r)),
        vec![
            RequestObservation::AdmissionFailed(AdmissionFailure::QueueFull),
            RequestObservation::Ended { attempts: 0 },
        ]
    );
}

#[test]
fn a_lost_transport_before_commit_fails_over_avoiding_the_provider_r_fail_1() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::StreamEnded);
    let outs = drain(&mut r);
    assert!(deliveries(&outs).is_empty(), "the client sees nothing yet");
    let admit = commands(&outs)
        .into_iter()
        .find_map(|c| match c {
            RequestCommand::Admit(d) => Some(d),
            _ => None,
        })
        .expect("re-admitted");
    assert_eq!(admit.avoid_provider_id, Some(ProviderId::from("p0")));
    assert!(!admit.allow_avoided_fallback);
}

#[test]
fn a_retryable_provider_failure_fails_over_and_a_non_retryable_one_never_r_fail_1() {
    for (retryable, fails_over) in [(true, true), (false, false)] {
        let mut r = Request::new(t(0), spec(None, &[]));
        let l = lease(1, "p0", AdapterKind::Mock);
        running(&mut r, &l);
        let mut failure = ExecutionFailure::new(FailureCode::NodeOverloaded);
        failure.retryable = retryable;
        r.handle_input(t(2), run(RunEventKind::Failed(failure)));
        drain(&mut r);
        r.handle_input(
            t(3),
            RequestInput::Dispatch(RequestEvent::Terminal {
                lease_id: 1,
                verdict: applied(&l),
            }),
        );
        let outs = drain(&mut r);
        let readmitted = commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_)));
        assert_eq!(readmitted, fails_over, "retryable={retryable}: {outs:?}");
        assert_eq!(deliveries(&outs).is_empty(), fails_over);
    }
}

fn durable_spec() -> RequestSpec {
    let mut s = spec(None, &[]);
    s.journal = Some(crate::edge::durable::JournalSpec {
        response_id: "resp_1".into(),
        epoch: 1,
        batch_until_terminal: false,
    });
    s
}

fn journal_writes(outs: &[RequestOutput]) -> Vec<crate::edge::durable::JournalWrite> {
    outs.iter()
        .filter_map(|o| match o {
            RequestOutput::Journal(w) => Some(w.clone()),
            _ => None,
        })
        .collect()
}

fn text(s: &str) -> RunEventKind {
    RunEventKind::TextDelta(s.into())
}

#[test]
fn r_jrn_1_a_durable_response_publishes_content_only_after_it_is_durable() {
    use crate::edge::durable::{JournalAck, JournalWrite};
    let mut r = Request::new(t(0), durable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("Hel")));
    let outs = drain(&mut r);
    // The head goes out; the content waits for its append.
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Commit { tunnel_head: None }]
    );
    let writes = journal_writes(&outs);
    assert!(matches!(&writes[..], [JournalWrite::Append { events, .. }] if events.len() == 1));
    // More content while the append syncs: held, no second write.
    r.handle_input(t(3), run(text("lo")));
    let outs = drain(&mut r);
    assert!(deliveries(&outs).is_empty());
    assert!(journal_writes(&outs).is_empty());
    r.handle_input(t(4), RequestInput::Journaled(JournalAck::Appended));
    let outs = drain(&mut r);
    assert_eq!(deliveries(&outs), vec![Delivery::Event(text("Hel"))]);
    assert!(
        matches!(&journal_writes(&outs)[..], [JournalWrite::Append { events, .. }] if events[0].seq == 2)
    );
    r.handle_input(t(5), RequestInput::Journaled(JournalAck::Appended));
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![Delivery::Event(text("lo"))]
    );
    assert_eq!(r.durable_seq(), 2);
    // The terminal: the completion event is journaled, then the terminal
    // written, and only then Finish reaches the client.
    r.handle_input(t(6), run(completed()));
    drain(&mut r);
    r.handle_input(
        t(7),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(&l),
        }),
    );
    let outs = drain(&mut r);
    assert!(deliveries(&outs).is_empty());
    assert!(!r.is_ended(), "journal writes are pending");
    r.handle_input(t(8), RequestInput::Journaled(JournalAck::Appended));
    let outs = drain(&mut r);
    assert_eq!(deliveries(&outs), vec![Delivery::Event(completed())]);
    assert!(matches!(
        &journal_writes(&outs)[..],
        [JournalWrite::Finish { terminal, .. }] if terminal.status == crate::journal::RecordStatus::Completed
    ));
    r.handle_input(t(9), RequestInput::Journaled(JournalAck::Finished));
    assert_eq!(deliveries(&drain(&mut r)), vec![Delivery::Finish]);
    assert!(r.is_ended());
}

#[test]
fn a_durable_response_outlives_its_client_and_ends_cancelled_on_cancel() {
    use crate::edge::durable::{JournalAck, JournalWrite};
    let mut r = Request::new(t(0), durable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::ClientDisconnected);
    let outs = drain(&mut r);
    assert!(commands(&outs).is_empty(), "the run goes on: {outs:?}");
    assert!(!r.is_ended());
    r.handle_input(t(3), RequestInput::Cancel);
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert!(commands(&outs).contains(&cancel()));
    assert!(matches!(
        &journal_writes(&outs)[..],
        [JournalWrite::Finish { terminal, .. }] if terminal.status == crate::journal::RecordStatus::Cancelled
    ));
    r.handle_input(t(4), RequestInput::Journaled(JournalAck::Finished));
    assert!(matches!(
        &deliveries(&drain(&mut r))[..],
        [Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::Canceled),
            ..
        }]
    ));
    assert!(r.is_ended());
}

#[test]
fn r_jrn_3_a_fenced_durable_response_stops_its_run_and_publishes_nothing_more() {
    use crate::edge::durable::JournalAck;
    use crate::journal::JournalError;
    let mut r = Request::new(t(0), durable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("a")));
    drain(&mut r);
    r.handle_input(
        t(3),
        RequestInput::Journaled(JournalAck::Refused(JournalError::Fenced {
            current: 2,
            writer: 1,
        })),
    );
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert!(
        journal_writes(&outs).is_empty(),
        "a fenced writer writes nothing"
    );
    assert_eq!(
        deliveries(&outs),
        vec![],
        "neither the unjournaled text nor a terminal reaches a client: the \
         record goes on under the Edge that took it (R-JRN-1)"
    );
    assert_eq!(
        outs.iter()
            .filter(|o| **o == RequestOutput::Observe(RequestObservation::RecordTaken))
            .count(),
        1,
        "the driver hears the record was taken, once"
    );
    assert!(r.is_ended());
    assert!(!r.record_left_open(), "the record is the other Edge's");
    assert!(
        r.answer_charged_elsewhere(),
        "R-TEN-2: the Edge that took it charges what the journal holds"
    );
}

/// R-JRN-1, R-JRN-4: a store failure is not a takeover: the client of a
/// refused append still gets its one error terminal (the record gets a
/// `failed` one).
#[test]
fn r_jrn_1_a_refused_append_still_ends_its_client_with_an_error() {
    use crate::edge::durable::JournalAck;
    use crate::journal::JournalError;
    let mut r = Request::new(t(0), durable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("a")));
    drain(&mut r);
    r.handle_input(
        t(3),
        RequestInput::Journaled(JournalAck::Refused(JournalError::Store(
            "unavailable".into(),
        ))),
    );
    let outs = drain(&mut r);
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Fail {
            kind: GateFailure::Attempt(FailureCode::Internal),
            in_stream: true,
            provider: None,
        }],
    );
    assert!(
        !outs.contains(&RequestOutput::Observe(RequestObservation::RecordTaken)),
        "a failed store took nothing over"
    );
}

#[test]
fn a_durable_record_past_its_bound_still_gets_a_failed_terminal() {
    use crate::edge::durable::{JournalAck, JournalWrite};
    use crate::journal::{JournalError, RecordStatus};
    let mut r = Request::new(t(0), durable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("a")));
    drain(&mut r);
    r.handle_input(
        t(3),
        RequestInput::Journaled(JournalAck::Refused(JournalError::RecordTooLarge)),
    );
    let outs = drain(&mut r);
    assert!(matches!(
        &journal_writes(&outs)[..],
        [JournalWrite::Finish { terminal, .. }]
            if terminal.status == RecordStatus::Failed
                && terminal.reason.as_deref() == Some("response_too_large")
    ));
    assert!(!r.is_ended());
    r.handle_input(t(4), RequestInput::Journaled(JournalAck::Finished));
    assert!(deliveries(&drain(&mut r)).is_empty(), "one terminal only");
    assert!(r.is_ended());
}

#[test]
fn a_durable_response_stops_reading_when_its_journal_falls_behind() {
    let mut r = Request::new(t(0), durable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    for _ in 0..crate::edge::durable::MAX_UNPUBLISHED {
        assert!(r.wants_frames());
        r.handle_input(t(2), run(text("x")));
    }
    drain(&mut r);
    assert!(!r.wants_frames());
    r.handle_input(
        t(3),
        RequestInput::Journaled(crate::edge::durable::JournalAck::Appended),
    );
    assert!(r.wants_frames());
}

fn parkable_spec() -> RequestSpec {
    let mut s = durable_spec();
    s.park_grace_ms = 30_000;
    s
}

fn acks(outs: &[RequestOutput]) -> Vec<u64> {
    outs.iter()
        .filter_map(|o| match o {
            RequestOutput::AckFrames { through_frame } => Some(*through_frame),
            _ => None,
        })
        .collect()
}

fn appended_sources(outs: &[RequestOutput]) -> Vec<Option<crate::edge::durable::FrameSource>> {
    journal_writes(outs)
        .into_iter()
        .flat_map(|w| match w {
            crate::edge::durable::JournalWrite::Append { events, .. } => events,
            _ => Vec::new(),
        })
        .map(|e| crate::edge::durable::decode_entry(&e.payload).and_then(|e| e.source))
        .collect()
}

fn offer(key: iop_wire::RunKey, last_frame: u64) -> ParkedOffer {
    ParkedOffer {
        run: iop_wire::ParkedRun {
            key,
            response_id: "resp_1".into(),
            adapter: AdapterKind::Mock,
            target: "m".into(),
            first_kept_frame: 1,
            last_frame,
            ended: false,
        },
        provider_id: ProviderId::from("p0"),
        node: NodeId::from("n"),
    }
}

/// A durable run on `l` with two text frames, both durable.
fn durable_with_two_frames(r: &mut Request, l: &Lease) -> Vec<RequestOutput> {
    running(r, l);
    r.handle_input(t(2), run(text("a")));
    let mut outs = drain(r);
    r.handle_input(t(3), RequestInput::Journaled(JournalAck::Appended));
    outs.extend(drain(r));
    r.handle_input(t(4), run(text("b")));
    outs.extend(drain(r));
    r.handle_input(t(5), RequestInput::Journaled(JournalAck::Appended));
    outs.extend(drain(r));
    outs
}

#[test]
fn r_park_1_frames_are_acked_once_their_journal_events_are_durable() {
    let mut r = Request::new(t(0), parkable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("a")));
    let outs = drain(&mut r);
    assert!(acks(&outs).is_empty(), "not durable yet");
    let key = iop_wire::RunKey {
        generation: l.generation,
        run_id: l.run_id,
    };
    assert_eq!(
        appended_sources(&outs),
        vec![Some(crate::edge::durable::FrameSource {
            key,
            frame: 1,
            provider_id: ProviderId::from("p0"),
        })],
        "each journal event names its frame"
    );
    r.handle_input(t(3), RequestInput::Journaled(JournalAck::Appended));
    assert_eq!(acks(&drain(&mut r)), vec![1]);
    // The terminal frame is acked only once the record's terminal is.
    r.handle_input(t(4), run(completed()));
    r.handle_input(
        t(5),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(&l),
        }),
    );
    drain(&mut r);
    r.handle_input(t(5), RequestInput::Journaled(JournalAck::Appended));
    assert!(
        acks(&drain(&mut r)).is_empty(),
        "the completion is durable, not the terminal"
    );
    r.handle_input(t(6), RequestInput::Journaled(JournalAck::Finished));
    assert_eq!(acks(&drain(&mut r)), vec![2]);
    assert!(r.is_ended());
}

#[test]
fn r_park_2_a_committed_durable_run_that_loses_its_connection_is_adopted_where_it_left_off() {
    let mut r = Request::new(t(0), parkable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    durable_with_two_frames(&mut r, &l);
    let key = iop_wire::RunKey {
        generation: l.generation,
        run_id: l.run_id,
    };
    // R-GEN-3: the connection is gone; the run waits on its node.
    r.handle_input(
        t(6),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert!(outs.contains(&RequestOutput::Observe(RequestObservation::Parked)));
    assert!(deliveries(&outs).is_empty(), "no error: the run is parked");
    assert!(r.awaits_parked(key));
    // Another run's report is not this request's.
    let other = iop_wire::RunKey {
        generation: 9,
        run_id: 9,
    };
    r.handle_input(t(7), RequestInput::ParkedRun(offer(other, 5)));
    assert!(drain(&mut r).is_empty());
    // Its node reports it on a new connection: adopt it.
    r.handle_input(t(8), RequestInput::ParkedRun(offer(key, 3)));
    assert_eq!(
        commands(&drain(&mut r)),
        vec![RequestCommand::Adopt {
            request_id: RID,
            node: NodeId::from("n"),
            key
        }]
    );
    let mut l2 = lease(2, "p0", AdapterKind::Mock);
    l2.generation = 4;
    r.handle_input(
        t(9),
        RequestInput::Dispatch(RequestEvent::Leased(l2.clone())),
    );
    drain(&mut r);
    r.handle_input(
        t(9),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l2.clone()))),
    );
    let outs = drain(&mut r);
    assert!(
        matches!(
            &outs[..],
            [RequestOutput::Open { adopt: Some(AdoptSpec { key: k, resume_after_frame: 2 }), tunnel: false, .. }] if *k == key
        ),
        "resume after the last frame the journal holds (R-TEN-2: and no \
         reservation, an adoption sends nothing again): {outs:?}"
    );
    assert_eq!(r.gate().attempts(), 1, "the same attempt goes on");
    r.handle_input(t(10), RequestInput::Opened);
    assert!(drain(&mut r).contains(&RequestOutput::Observe(RequestObservation::Adopted)));
    // The node's next frame is frame 3 of the same run.
    r.handle_input(t(11), run(text("c")));
    let outs = drain(&mut r);
    assert_eq!(
        appended_sources(&outs),
        vec![Some(crate::edge::durable::FrameSource {
            key,
            frame: 3,
            provider_id: ProviderId::from("p0"),
        })]
    );
}

#[test]
fn r_park_1_a_parked_run_no_node_reports_in_time_ends_with_one_in_stream_error() {
    let mut r = Request::new(t(0), parkable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    durable_with_two_frames(&mut r, &l);
    r.handle_input(t(6), RequestInput::StreamEnded);
    drain(&mut r);
    let until = r.poll_timeout().expect("the park wait is timed");
    assert_eq!(
        until,
        t(6).saturating_add(Duration::from_millis(30_000) + PARK_REPORT_SLACK)
            .min(r.gate().deadline())
    );
    r.handle_timeout(r.gate().deadline().min(until));
    let outs = drain(&mut r);
    let finish = journal_writes(&outs);
    assert!(
        matches!(&finish[..], [crate::edge::durable::JournalWrite::Finish { terminal, .. }]
            if terminal.status == crate::journal::RecordStatus::Failed),
        "{outs:?}"
    );
}

#[test]
fn an_ephemeral_or_uncommitted_run_is_not_parked() {
    // Ephemeral: the lost connection re-admits as before (R-FAIL-1).
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    let outs = drain(&mut r);
    assert!(
        commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_)))
    );
    // Durable but not committed: also re-admitted, never parked.
    let mut r = Request::new(t(0), parkable_spec());
    running(&mut r, &l);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    let outs = drain(&mut r);
    assert!(!outs.contains(&RequestOutput::Observe(RequestObservation::Parked)));
    assert!(
        commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_)))
    );
}

#[test]
fn r_take_1_an_adopter_resumes_the_parked_run_and_never_starts_the_prompt_again() {
    let key = iop_wire::RunKey {
        generation: 3,
        run_id: 101,
    };
    let mut spec = parkable_spec();
    if let Some(j) = &mut spec.journal {
        j.epoch = 2;
    }
    let mut r = Request::adopting(t(0), spec, &offer(key, 5), 4, 3, None);
    let outs = drain(&mut r);
    assert_eq!(
        commands(&outs),
        vec![RequestCommand::Adopt {
            request_id: RID,
            node: NodeId::from("n"),
            key
        }],
        "no admission: {outs:?}"
    );
    // The hold is gone: the record ends in the stream, nothing re-admitted.
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Rejected(AdmitRejection::NoRoute)),
    );
    let outs = drain(&mut r);
    assert!(
        !commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_)))
    );
    assert!(matches!(
        &journal_writes(&outs)[..],
        [crate::edge::durable::JournalWrite::Finish { epoch: 2, .. }]
    ));
}

#[test]
fn r_take_1_an_adopter_appends_after_the_durable_prefix_with_its_epoch() {
    let key = iop_wire::RunKey {
        generation: 3,
        run_id: 101,
    };
    let mut spec = parkable_spec();
    if let Some(j) = &mut spec.journal {
        j.epoch = 2;
    }
    let mut r = Request::adopting(t(0), spec, &offer(key, 5), 4, 3, None);
    drain(&mut r);
    let l = lease(2, "p0", AdapterKind::Mock);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    drain(&mut r);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    let outs = drain(&mut r);
    assert!(matches!(
        &outs[..],
        [RequestOutput::Open {
            adopt: Some(AdoptSpec {
                resume_after_frame: 3,
                ..
            }),
            ..
        }]
    ));
    r.handle_input(t(2), RequestInput::Opened);
    drain(&mut r);
    r.handle_input(t(3), run(text("d")));
    let outs = drain(&mut r);
    match &journal_writes(&outs)[..] {
        [crate::edge::durable::JournalWrite::Append { epoch, events, .. }] => {
            assert_eq!((*epoch, events[0].seq), (2, 5), "after event 4, as epoch 2");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        appended_sources(&outs),
        vec![Some(crate::edge::durable::FrameSource {
            key,
            frame: 4,
            provider_id: ProviderId::from("p0"),
        })]
    );
}

/// A durable request whose run completed: its completion event is
/// journaled and its terminal is next.
fn durable_completed(r: &mut Request) -> Lease {
    let l = lease(1, "p0", AdapterKind::Mock);
    running(r, &l);
    r.handle_input(t(2), run(text("a")));
    r.handle_input(t(3), RequestInput::Journaled(JournalAck::Appended));
    r.handle_input(t(4), run(completed()));
    r.handle_input(
        t(5),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(&l),
        }),
    );
    drain(r);
    l
}

#[test]
fn r_jrn_4_an_append_refused_while_the_terminal_waits_still_ends_the_record() {
    use crate::edge::durable::JournalWrite;
    use crate::journal::{JournalError, RecordStatus};
    let mut r = Request::new(t(0), durable_spec());
    durable_completed(&mut r);
    // The completion's append fails; the Completed terminal waited behind it.
    r.handle_input(
        t(6),
        RequestInput::Journaled(JournalAck::Refused(JournalError::Store("disk".into()))),
    );
    let outs = drain(&mut r);
    assert!(
        matches!(&journal_writes(&outs)[..], [JournalWrite::Finish { terminal, .. }]
            if terminal.status == RecordStatus::Failed),
        "the record ends failed: {outs:?}"
    );
    assert!(!r.is_ended(), "its terminal write is out");
    r.handle_input(t(7), RequestInput::Journaled(JournalAck::Finished));
    assert!(r.is_ended());
}

/// R-TEN-2, R-JRN-6: the completion's append the store refused carried
/// the provider's usage report; no client sees it, yet the provider
/// counted it, so the request settles with it. A fenced one does not (the
/// Edge that took the record charges).
#[test]
fn r_ten_2_a_usage_report_the_store_refused_is_still_settled() {
    use crate::journal::JournalError;
    let mut r = Request::new(t(0), durable_spec());
    durable_completed(&mut r);
    assert_eq!(r.relayed_usage(), None, "on its way to the journal");
    r.handle_input(
        t(6),
        RequestInput::Journaled(JournalAck::Refused(JournalError::Store("disk".into()))),
    );
    let outs = drain(&mut r);
    assert!(
        !deliveries(&outs)
            .iter()
            .any(|d| matches!(d, Delivery::Event(RunEventKind::Completed { .. }))),
        "never published: {outs:?}"
    );
    r.handle_input(t(7), RequestInput::Journaled(JournalAck::Finished));
    assert!(r.is_ended());
    assert_eq!(r.relayed_usage(), Some(Usage::tokens(3, 2)));
    assert_eq!(r.unmetered(), unmetered(0, 0), "the report covers it");

    let mut r = Request::new(t(0), durable_spec());
    durable_completed(&mut r);
    r.handle_input(
        t(6),
        RequestInput::Journaled(JournalAck::Refused(JournalError::Fenced {
            current: 2,
            writer: 1,
        })),
    );
    drain(&mut r);
    assert_eq!(r.relayed_usage(), None, "the Edge that took it charges");
}

#[test]
fn r_jrn_4_a_terminal_the_store_failed_is_written_again_then_given_up() {
    use crate::edge::durable::{JournalWrite, MAX_TERMINAL_WRITES};
    use crate::journal::{JournalError, RecordStatus};
    let mut r = Request::new(t(0), durable_spec());
    durable_completed(&mut r);
    r.handle_input(t(6), RequestInput::Journaled(JournalAck::Appended));
    let outs = drain(&mut r);
    assert!(matches!(
        &journal_writes(&outs)[..],
        [JournalWrite::Finish { .. }]
    ));
    let mut now = t(6);
    for attempt in 1..MAX_TERMINAL_WRITES {
        r.handle_input(
            now,
            RequestInput::Journaled(JournalAck::Refused(JournalError::Store("disk".into()))),
        );
        assert!(journal_writes(&drain(&mut r)).is_empty(), "not at once");
        assert!(
            !r.is_ended(),
            "attempt {attempt}: the terminal is still owed"
        );
        let at = r.poll_timeout().expect("a retry is timed");
        assert_eq!(at, now.saturating_add(JOURNAL_RETRY));
        r.handle_timeout(at);
        now = at;
        let outs = drain(&mut r);
        assert!(
            matches!(&journal_writes(&outs)[..], [JournalWrite::Finish { terminal, .. }]
                if terminal.status == RecordStatus::Completed),
            "the same terminal again: {outs:?}"
        );
    }
    assert!(!r.record_left_open(), "still writing it");
    // Past the bound it gives up: its Edge's custody ends the record
    // (`CustodyInput::RunLeftOpen`).
    r.handle_input(
        now,
        RequestInput::Journaled(JournalAck::Refused(JournalError::Store("disk".into()))),
    );
    drain(&mut r);
    assert!(r.is_ended());
    assert!(
        r.record_left_open(),
        "the record is left without its terminal"
    );
    // And a terminal that is accepted ends it at once.
    let mut r = Request::new(t(0), durable_spec());
    durable_completed(&mut r);
    r.handle_input(t(6), RequestInput::Journaled(JournalAck::Appended));
    drain(&mut r);
    r.handle_input(
        t(7),
        RequestInput::Journaled(JournalAck::Refused(JournalError::Store("disk".into()))),
    );
    r.handle_timeout(t(7).saturating_add(JOURNAL_RETRY));
    drain(&mut r);
    r.handle_input(t(8), RequestInput::Journaled(JournalAck::Finished));
    let outs = drain(&mut r);
    assert!(deliveries(&outs).contains(&Delivery::Finish));
    assert!(r.is_ended());
    assert!(!r.record_left_open());
}

fn continuing_spec() -> RequestSpec {
    let mut s = spec(None, &[]);
    s.continuation = true;
    s
}

/// Lease, pre-send and open `l` on a request that is (re)admitting.
fn reopen(r: &mut Request, l: &Lease) -> Vec<RequestOutput> {
    r.handle_input(
        t(20),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    drain(r);
    r.handle_input(
        t(20),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    let outs = drain(r);
    r.handle_input(t(21), RequestInput::Opened);
    drain(r);
    outs
}

#[test]
fn r_cont_1_a_lost_committed_attempt_continues_with_the_answer_so_far() {
    let mut r = Request::new(t(0), continuing_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("tok0")));
    r.handle_input(t(3), run(text(" tok1")));
    r.handle_input(
        t(4),
        run(RunEventKind::Usage(Usage {
            cache_read_tokens: Some(2),
            ..Usage::tokens(3, 2)
        })),
    );
    drain(&mut r);
    r.handle_input(
        t(5),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    let outs = drain(&mut r);
    assert!(deliveries(&outs).is_empty(), "no error: the answer goes on");
    let admit = commands(&outs)
        .into_iter()
        .find_map(|c| match c {
            RequestCommand::Admit(a) => Some(a),
            _ => None,
        })
        .expect("re-admitted");
    assert_eq!(admit.avoid_provider_id, Some(ProviderId::from("p0")));
    let l2 = lease(2, "p1", AdapterKind::Mock);
    let outs = reopen(&mut r, &l2);
    let open = outs
        .iter()
        .find_map(|o| match o {
            RequestOutput::Open {
                continuation,
                tunnel,
                ..
            } => Some((continuation.clone(), *tunnel)),
            _ => None,
        })
        .expect("opened");
    assert_eq!(
        open,
        (Some("tok0 tok1".to_owned()), false),
        "the prefix, never a tunnel"
    );
    // The continued attempt's text follows; the usage is both attempts'
    // (a cache count only one of them reported is that one's).
    r.handle_input(t(22), run(text(" tok2")));
    r.handle_input(
        t(23),
        run(RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(Usage {
                cache_read_tokens: Some(4),
                cache_write_tokens: Some(1),
                ..Usage::tokens(5, 1)
            }),
        }),
    );
    r.handle_input(
        t(24),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l2.lease_id,
            verdict: applied(&l2),
        }),
    );
    let ds = deliveries(&drain(&mut r));
    assert_eq!(ds.first(), Some(&Delivery::Event(text(" tok2"))));
    assert!(ds.contains(&Delivery::Event(RunEventKind::Completed {
        finish_reason: FinishReason::Stop,
        usage: Some(Usage {
            cache_read_tokens: Some(6),
            cache_write_tokens: Some(1),
            ..Usage::tokens(8, 3)
        }),
    })));
    assert_eq!(ds.last(), Some(&Delivery::Finish));
    assert_eq!(r.gate().attempts(), 2);
    assert_eq!(r.unmetered_output_tokens(), 0, "both attempts reported");
}

#[test]
fn r_ten_2_an_attempt_cut_without_usage_is_charged_by_an_estimate_of_its_text() {
    let mut r = Request::new(t(0), continuing_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    // Nine characters, no usage report: 3 tokens estimated.
    r.handle_input(t(2), run(text("tok0 tok1")));
    drain(&mut r);
    assert_eq!(r.unmetered_output_tokens(), 3, "the attempt so far");
    r.handle_input(
        t(5),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    drain(&mut r);
    let l2 = lease(2, "p1", AdapterKind::Mock);
    reopen(&mut r, &l2);
    r.handle_input(t(22), run(text(" tok2")));
    assert_eq!(
        r.unmetered_output_tokens(),
        3 + 2,
        "the continuation's too, so far"
    );
    r.handle_input(
        t(23),
        run(RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(Usage::tokens(12, 2)),
        }),
    );
    r.handle_input(
        t(24),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l2.lease_id,
            verdict: applied(&l2),
        }),
    );
    drain(&mut r);
    // The continuation's report covers its own text, never the cut one's.
    assert_eq!(r.unmetered_output_tokens(), 3);
}

#[test]
fn r_ten_2_an_unreported_attempt_s_reasoning_and_tool_calls_are_estimated_with_its_text() {
    let mut r = Request::new(t(0), continuing_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("tok0")));
    r.handle_input(t(3), run(RunEventKind::ReasoningDelta("thinking".into())));
    r.handle_input(
        t(4),
        run(RunEventKind::ToolCallDelta(iop_wire::ToolCallDelta {
            index: 0,
            id: Some("call_1".into()),
            name: Some("get".into()),
            arguments_delta: "{\"a\":1}".into(),
        })),
    );
    drain(&mut r);
    // 4 + 8 + 3 + 7 characters: 22, 6 tokens.
    assert_eq!(r.unmetered_output_tokens(), 6);
    r.handle_input(
        t(5),
        run(RunEventKind::Completed {
            finish_reason: FinishReason::ToolCalls,
            usage: Some(Usage::tokens(12, 9)),
        }),
    );
    r.handle_input(
        t(6),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(&l),
        }),
    );
    drain(&mut r);
    assert_eq!(r.unmetered_output_tokens(), 0, "reported");
}

#[test]
fn r_ten_2_a_takeover_charges_the_answer_so_far_only_when_no_usage_covers_it() {
    let mut spec = durable_spec();
    spec.continuation = true;
    let mut unreported = resumed("Hello, wor", 6);
    unreported.usage = None;
    let r = Request::continuing(t(0), spec.clone(), &unreported);
    assert_eq!(r.unmetered_output_tokens(), 3, "ten characters");
    let r = Request::continuing(t(0), spec, &resumed("Hello, wor", 6));
    assert_eq!(
        r.unmetered_output_tokens(),
        0,
        "its usage reached the journal"
    );
    // An adopted run's report at its end covers the text before the cut.
    let key = iop_wire::RunKey {
        generation: 3,
        run_id: 101,
    };
    let mut spec = parkable_spec();
    spec.continuation = true;
    let mut unreported = resumed("Hello", 4);
    unreported.usage = None;
    let r = Request::adopting(t(0), spec, &offer(key, 5), 4, 3, Some(&unreported));
    assert_eq!(r.unmetered_output_tokens(), 2, "until the run reports");
}

#[test]
fn r_cont_1_never_while_a_tool_call_is_partly_out() {
    let mut r = Request::new(t(0), continuing_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(
        t(2),
        run(RunEventKind::ToolCallDelta(iop_wire::ToolCallDelta {
            index: 0,
            id: Some("call_1".into()),
            name: Some("f".into()),
            arguments_delta: "{\"a".into(),
        })),
    );
    drain(&mut r);
    r.handle_input(
        t(3),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    let outs = drain(&mut r);
    assert!(
        deliveries(&outs).iter().any(|d| matches!(
            d,
            Delivery::Fail {
                in_stream: true,
                ..
            }
        )),
        "one in-stream error: {outs:?}"
    );
}

#[test]
fn r_park_2_a_report_of_the_same_run_from_another_provider_is_not_adopted() {
    let mut r = Request::new(t(0), parkable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    durable_with_two_frames(&mut r, &l);
    let key = iop_wire::RunKey {
        generation: l.generation,
        run_id: l.run_id,
    };
    r.handle_input(
        t(6),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    drain(&mut r);
    let mut foreign = offer(key, 3);
    foreign.provider_id = ProviderId::from("p1");
    r.handle_input(t(7), RequestInput::ParkedRun(foreign));
    assert!(
        commands(&drain(&mut r)).is_empty(),
        "another node cannot take this run"
    );
    assert!(r.awaits_parked(key));
}

// Tests below were written against mutants of this module that survived
// (docs/simulation.md, "Mutation testing").

#[test]
fn the_accessors_report_the_request_its_attempts_lease_and_what_it_holds() {
    let mut r = Request::new(t(0), spec(None, &[]));
    assert_eq!(r.request_id(), RID);
    assert_eq!(r.attempt_lease(), None, "admitting: no attempt");
    drain(&mut r);
    let l = lease(1, "p0", AdapterKind::Mock);
    r.handle_input(
        t(0),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    assert_eq!(r.attempt_lease(), None, "pre-sending: not yet an attempt");
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    assert_eq!(r.attempt_lease(), Some(&l), "opening");
    r.handle_input(t(1), RequestInput::Opened);
    assert_eq!(r.attempt_lease(), Some(&l), "running");
    drain(&mut r);
    // A held non-content event counts its decoded size and the item's
    // overhead (R-LIM-3).
    let usage = RunEventKind::Usage(Usage::tokens(300, 70_000));
    let size = postcard::experimental::serialized_size(&usage).unwrap();
    assert!(size > 1);
    r.handle_input(t(2), run(usage));
    assert_eq!(r.held_bytes(), HELD_ITEM_OVERHEAD + size);
    r.handle_input(t(3), run(text("a")));
    drain(&mut r);
    assert_eq!(r.held_bytes(), 0, "commit flushed the buffer");
    r.handle_input(t(4), run(completed()));
    assert_eq!(r.attempt_lease(), None, "awaiting the verdict");
}

#[test]
fn a_client_that_leaves_while_queued_closes_no_stream_r_gate_4() {
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    r.handle_input(t(1), RequestInput::Dispatch(RequestEvent::Queued));
    r.handle_input(t(2), RequestInput::ClientDisconnected);
    let outs = drain(&mut r);
    assert!(
        !outs.contains(&RequestOutput::CloseAttempt),
        "there is no node stream: {outs:?}"
    );
    assert_eq!(commands(&outs), vec![cancel()]);
    assert!(r.is_ended());
}

#[test]
fn a_stale_queued_answer_leaves_a_running_attempt_running() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::Dispatch(RequestEvent::Queued));
    assert!(drain(&mut r).is_empty());
    r.handle_input(t(3), run(text("a")));
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![
            Delivery::Commit { tunnel_head: None },
            Delivery::Event(text("a"))
        ]
    );
    // And a rejection after the queue answer is not this request's any
    // more (the queue answer came first).
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    r.handle_input(t(1), RequestInput::Dispatch(RequestEvent::Queued));
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::Rejected(AdmitRejection::QueueFull)),
    );
    assert!(drain(&mut r).is_empty());
    assert!(!r.is_ended());
}

#[test]
fn only_a_fence_of_the_attempts_own_lease_ends_it_r_gen_3() {
    let l = lease(1, "p0", AdapterKind::Mock);
    let other = lease(9, "p1", AdapterKind::Mock);
    // Running.
    let mut r = Request::new(t(0), spec(None, &[]));
    running(&mut r, &l);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(other.clone())),
    );
    assert!(drain(&mut r).is_empty());
    r.handle_input(t(3), run(text("a")));
    assert_eq!(deliveries(&drain(&mut r)).len(), 2, "still running");
    // Opening.
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    opening(&mut r, &l);
    drain(&mut r);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(other)),
    );
    assert!(drain(&mut r).is_empty());
    assert_eq!(r.attempt_lease(), Some(&l));
    r.handle_input(t(3), RequestInput::Dispatch(RequestEvent::LeaseFenced(l)));
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt));
    assert!(lost_transport(&outs), "{outs:?}");
    assert!(
        admits(&outs),
        "a lost transport before commit fails over: {outs:?}"
    );
}

#[test]
fn a_pre_send_answer_about_another_lease_is_ignored_r_gen_4() {
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    let l = lease(1, "p0", AdapterKind::Mock);
    r.handle_input(
        t(0),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    drain(&mut r);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(lease(
            2,
            "p1",
            AdapterKind::Mock,
        )))),
    );
    assert!(drain(&mut r).is_empty());
    assert_eq!(r.gate().attempts(), 0);
    r.handle_input(
        t(2),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    assert!(
        drain(&mut r)
            .iter()
            .any(|o| matches!(o, RequestOutput::Open { lease, .. } if *lease == l))
    );
}

/// A durable request whose committed run lost its stream at `t(6)` and is
/// parked on its node with a grace of one second.
fn parked_briefly() -> (Request, Lease, iop_wire::RunKey) {
    let mut s = durable_spec();
    s.park_grace_ms = 1_000;
    let mut r = Request::new(t(0), s);
    let l = lease(1, "p0", AdapterKind::Mock);
    durable_with_two_frames(&mut r, &l);
    let key = iop_wire::RunKey {
        generation: l.generation,
        run_id: l.run_id,
    };
    assert!(!r.awaits_parked(key), "running, not parked");
    r.handle_input(t(6), RequestInput::StreamEnded);
    assert!(drain(&mut r).contains(&RequestOutput::Observe(RequestObservation::Parked)));
    assert!(r.awaits_parked(key));
    assert!(!r.awaits_parked(iop_wire::RunKey {
        generation: 9,
        run_id: 9
    }));
    (r, l, key)
}

#[test]
fn r_park_1_the_park_wait_is_its_grace_and_slack_and_ends_at_that_instant() {
    let (mut r, _, _) = parked_briefly();
    let wait = Duration::from_millis(1_000) + PARK_REPORT_SLACK;
    let until = t(6).saturating_add(wait);
    assert!(until < r.gate().deadline());
    assert_eq!(r.poll_timeout(), Some(until));
    r.handle_timeout(t(5).saturating_add(wait));
    assert!(drain(&mut r).is_empty(), "nothing fires early");
    r.handle_timeout(until);
    let outs = drain(&mut r);
    assert!(
        outs.contains(&RequestOutput::Observe(RequestObservation::AttemptEnded {
            failure: Some(FailureCode::TransportClosed)
        })),
        "{outs:?}"
    );
    assert!(matches!(
        &journal_writes(&outs)[..],
        [crate::edge::durable::JournalWrite::Finish { terminal, .. }]
            if terminal.status == crate::journal::RecordStatus::Failed
    ));
}

/// A node's registration report naming `runs` (of `resp_1`, or of
/// `resp_other` when `other_response`) on `generation`.
fn kept(
    node: &str,
    generation: u64,
    runs: &[iop_wire::RunKey],
    other_response: bool,
) -> RequestInput {
    let parked: Vec<iop_wire::ParkedRun> = runs
        .iter()
        .map(|key| {
            let mut run = offer(*key, 3).run;
            if other_response {
                run.response_id = "resp_other".into();
            }
            run
        })
        .collect();
    let kept = KeptRuns::from_registration(&NodeId::from(node), generation, &parked)
        .expect("a report under the bound is whole");
    RequestInput::KeptRuns(std::sync::Arc::new(kept))
}

/// The outputs of an attempt whose run its node no longer keeps: said so,
/// then as at the end of the park wait, one `transport_closed` attempt and
/// the record's failed terminal.
fn ended_lost(outs: &[RequestOutput]) -> bool {
    outs.contains(&RequestOutput::Observe(RequestObservation::RunNotKept))
        && outs.contains(&RequestOutput::Observe(RequestObservation::AttemptEnded {
            failure: Some(FailureCode::TransportClosed),
        }))
        && matches!(
            &journal_writes(outs)[..],
            [crate::edge::durable::JournalWrite::Finish { terminal, .. }]
                if terminal.status == crate::journal::RecordStatus::Failed
        )
}

#[test]
fn r_park_2_a_parked_run_its_node_registers_again_without_ends_at_once() {
    let (mut r, l, key) = parked_briefly();
    let newer = l.generation + 1;
    // Reports that say nothing about this run change nothing: another
    // node's, the same or an older generation's, one naming it, one
    // naming the same key of another response (R-MULTI-1).
    for report in [
        kept("other", newer, &[], false),
        kept("n0", l.generation, &[], false),
        kept("n0", l.generation - 1, &[], false),
        kept("n0", newer, &[key], false),
    ] {
        r.handle_input(t(7), report);
        assert!(drain(&mut r).is_empty());
        assert!(r.awaits_parked(key));
    }
    // Its node registered again and does not name it: the run is gone
    // (the node restarted), and the wait ends now, not at its grace.
    r.handle_input(t(8), kept("n0", newer + 1, &[key], true));
    let outs = drain(&mut r);
    assert!(ended_lost(&outs), "{outs:?}");
    assert!(!r.awaits_parked(key));
}

#[test]
fn r_park_2_a_run_its_node_does_not_keep_is_not_parked_when_its_fencing_comes_later() {
    let mut r = Request::new(t(0), parkable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    durable_with_two_frames(&mut r, &l);
    // The node's new registration is heard before the old lease's fence.
    r.handle_input(t(6), kept("n0", l.generation + 1, &[], false));
    assert!(drain(&mut r).is_empty(), "running: its stream decides");
    r.handle_input(
        t(7),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    let outs = drain(&mut r);
    assert!(ended_lost(&outs), "{outs:?}");
}

#[test]
fn r_park_2_an_offered_adoption_ends_when_a_later_registration_does_not_name_it() {
    let (mut r, _, key) = parked_briefly();
    let l2 = adoption_opening(&mut r, key, 100);
    // The adoption's stream fails before it opens: the run waits again.
    r.handle_input(t(101), RequestInput::OpenFailed(OpenFailure::Transport));
    drain(&mut r);
    assert!(r.awaits_parked(key));
    r.handle_input(t(102), kept("n0", l2.generation + 1, &[], false));
    assert!(ended_lost(&drain(&mut r)));
}

/// Drive a parked request's adoption to its `Open`, on lease 2.
fn adoption_opening(r: &mut Request, key: iop_wire::RunKey, at: u64) -> Lease {
    r.handle_input(t(at), RequestInput::ParkedRun(offer(key, 3)));
    assert_eq!(
        commands(&drain(r)),
        vec![RequestCommand::Adopt {
            request_id: RID,
            node: NodeId::from("n"),
            key
        }]
    );
    let mut l2 = lease(2, "p0", AdapterKind::Mock);
    l2.generation = 4;
    r.handle_input(
        t(at),
        RequestInput::Dispatch(RequestEvent::Leased(l2.clone())),
    );
    drain(r);
    // An answer about another lease changes nothing.
    r.handle_input(
        t(at),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(lease(
            5,
            "p0",
            AdapterKind::Mock,
        )))),
    );
    assert!(drain(r).is_empty());
    r.handle_input(
        t(at),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l2.clone()))),
    );
    assert!(matches!(
        &drain(r)[..],
        [RequestOutput::Open { adopt: Some(_), .. }]
    ));
    l2
}

#[test]
fn r_park_2_an_adoption_that_cannot_open_waits_for_the_runs_next_report() {
    for fail in ["open failed", "stream ended", "fenced"] {
        let (mut r, _, key) = parked_briefly();
        let l2 = adoption_opening(&mut r, key, 100);
        assert!(!r.awaits_parked(key), "{fail}: adopting");
        let input = match fail {
            "open failed" => RequestInput::OpenFailed(OpenFailure::Transport),
            "stream ended" => RequestInput::StreamEnded,
            _ => RequestInput::Dispatch(RequestEvent::LeaseFenced(l2.clone())),
        };
        r.handle_input(t(200), input);
        let outs = drain(&mut r);
        assert!(outs.contains(&RequestOutput::CloseAttempt), "{fail}");
        assert_eq!(commands(&outs), vec![cancel()], "{fail}: {outs:?}");
        assert!(deliveries(&outs).is_empty(), "{fail}: still parked");
        assert!(
            observations(&outs).is_empty(),
            "{fail}: the attempt goes on"
        );
        assert!(r.awaits_parked(key), "{fail}");
        assert_eq!(
            r.poll_timeout(),
            Some(t(200).saturating_add(Duration::from_millis(1_000) + PARK_REPORT_SLACK)),
            "{fail}: a fresh wait"
        );
        // The next report is adopted again, as the same attempt.
        adoption_opening(&mut r, key, 300);
        assert_eq!(r.gate().attempts(), 1, "{fail}");
    }
}

#[test]
fn r_park_1_a_durable_run_without_a_park_grace_is_not_parked() {
    let mut r = Request::new(t(0), durable_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    durable_with_two_frames(&mut r, &l);
    r.handle_input(t(6), RequestInput::StreamEnded);
    let outs = drain(&mut r);
    assert!(!outs.contains(&RequestOutput::Observe(RequestObservation::Parked)));
    assert!(lost_transport(&outs), "{outs:?}");
}

#[test]
fn a_durable_request_is_never_tunnelled_r_jrn_2_r_park_1() {
    // A durable answer is the Edge's, numbered and replayable, and the
    // node keeps (and the Edge acks) frames of normalized runs only: even
    // a tunnel provider that speaks the client's API gets a normalized
    // run.
    let mut s = durable_spec();
    s.park_grace_ms = 30_000;
    s.tunnel_api = Some(TunnelApi::OpenAi);
    s.tunnel_providers = vec![ProviderId::from("p0")];
    let mut r = Request::new(t(0), s);
    let outs = running(&mut r, &lease(1, "p0", AdapterKind::OpenAi));
    assert!(
        matches!(&outs[..], [RequestOutput::Open { tunnel: false, .. }]),
        "{outs:?}"
    );
}

#[test]
fn an_empty_text_delta_is_never_relayed() {
    let mut r = Request::new(t(0), spec(None, &[]));
    running(&mut r, &lease(1, "p0", AdapterKind::Mock));
    r.handle_input(t(2), run(text("")));
    r.handle_input(t(3), run(text("a")));
    r.handle_input(t(4), run(text("")));
    assert_eq!(
        deliveries(&drain(&mut r)),
        vec![
            Delivery::Commit { tunnel_head: None },
            Delivery::Event(text("a"))
        ]
    );
}

#[test]
fn the_pre_commit_buffer_takes_exactly_its_byte_bound_r_lim_3() {
    for (extra, fails) in [(0, false), (1, true)] {
        let mut r = Request::new(t(0), spec(Some(TunnelApi::OpenAi), &["p0"]));
        running(&mut r, &lease(1, "p0", AdapterKind::OpenAi));
        // A head counts its header names and values and the item overhead.
        let value = "y".repeat(MAX_HELD_BYTES - HELD_ITEM_OVERHEAD - 1 + extra);
        r.handle_input(
            t(2),
            RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Head {
                status: 200,
                headers: vec![("x".into(), value)],
            })),
        );
        let outs = deliveries(&drain(&mut r));
        assert_eq!(!outs.is_empty(), fails, "extra {extra}: {outs:?}");
        if !fails {
            assert_eq!(r.held_bytes(), MAX_HELD_BYTES);
        }
    }
}

#[test]
fn a_stream_that_ends_while_opening_is_a_lost_transport_r_gate_1() {
    let mut r = Request::new(t(0), spec(None, &[]));
    drain(&mut r);
    let l = lease(1, "p0", AdapterKind::Mock);
    opening(&mut r, &l);
    drain(&mut r);
    r.handle_input(t(2), RequestInput::StreamEnded);
    let outs = drain(&mut r);
    assert!(outs.contains(&RequestOutput::CloseAttempt), "{outs:?}");
    assert!(lost_transport(&outs), "{outs:?}");
    assert!(admits(&outs), "before commit it fails over: {outs:?}");
}

#[test]
fn a_continuing_attempt_sends_the_answer_so_far_as_the_assistants_final_message_r_cont_1() {
    let user = iop_wire::ChatMessage {
        role: iop_wire::Role::User,
        content: "hi".into(),
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        images: Vec::new(),
        cache_control: None,
        documents: Vec::new(),
    };
    assert_eq!(
        continued_messages(std::slice::from_ref(&user), None),
        vec![user.clone()]
    );
    let continued = continued_messages(std::slice::from_ref(&user), Some("Hello, wor"));
    assert_eq!(continued.len(), 2);
    assert_eq!(continued[0], user, "the request's own conversation first");
    assert_eq!(continued[1].role, iop_wire::Role::Assistant);
    assert_eq!(continued[1].content, "Hello, wor");
    assert!(continuation_allowed(iop_wire::RunApi::Chat, true));
    assert!(
        !continuation_allowed(iop_wire::RunApi::Chat, false),
        "opt-in"
    );
    for api in [
        iop_wire::RunApi::Generate,
        iop_wire::RunApi::Embeddings,
        iop_wire::RunApi::Completion,
    ] {
        assert!(!continuation_allowed(api, true), "{api:?}: chat only");
    }
}

fn resumed(text: &str, last_seq: u64) -> crate::edge::durable::ResumedAnswer {
    crate::edge::durable::ResumedAnswer {
        last_seq,
        text: text.into(),
        provider_id: Some(ProviderId::from("p0")),
        usage: Some(Usage::tokens(5, 2)),
    }
}

#[test]
fn r_take_1_r_cont_1_a_continuing_takeover_admits_a_continuation_never_the_prompt_alone() {
    let mut spec = durable_spec();
    spec.continuation = true;
    if let Some(j) = &mut spec.journal {
        j.epoch = 2;
    }
    let mut r = Request::continuing(t(0), spec, &resumed("Hello, wor", 6));
    let outs = drain(&mut r);
    let admits: Vec<_> = commands(&outs)
        .into_iter()
        .filter_map(|c| match c {
            RequestCommand::Admit(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(admits.len(), 1, "{outs:?}");
    assert_eq!(admits[0].avoid_provider_id, Some(ProviderId::from("p0")));
    assert!(
        admits[0].allow_avoided_fallback,
        "its Edge failed, not its provider: the same one may continue it"
    );
    assert!(
        deliveries(&outs).is_empty(),
        "the head is the journal's already"
    );
    // The attempt asks the provider to continue the answer so far.
    let l = lease(2, "p1", AdapterKind::Mock);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Leased(l.clone())),
    );
    drain(&mut r);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::PreSend(PreSend::Send(l.clone()))),
    );
    let outs = drain(&mut r);
    assert!(
        outs.iter().any(|o| matches!(
            o,
            RequestOutput::Open { continuation: Some(c), adopt: None, tunnel: false, .. }
                if c == "Hello, wor"
        )),
        "{outs:?}"
    );
    r.handle_input(t(2), RequestInput::Opened);
    r.handle_input(t(3), RequestInput::Frame(NodeFrame::Run(text("ld"))));
    let outs = drain(&mut r);
    // Numbered on from the journal, written with the raised epoch.
    let seqs: Vec<(u64, u64)> = journal_writes(&outs)
        .iter()
        .filter_map(|w| match w {
            crate::edge::durable::JournalWrite::Append { epoch, events, .. } => {
                Some((*epoch, events.first()?.seq))
            }
            _ => None,
        })
        .collect();
    assert_eq!(seqs, vec![(2, 7)]);
}

#[test]
fn r_take_1_a_continuing_takeover_without_continuation_ends_in_the_stream() {
    let mut spec = durable_spec();
    if let Some(j) = &mut spec.journal {
        j.epoch = 2;
    }
    let mut r = Request::continuing(t(0), spec, &resumed("Hel", 1));
    let outs = drain(&mut r);
    assert!(
        !commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_))),
        "never sent from scratch: {outs:?}"
    );
    assert!(matches!(
        &journal_writes(&outs)[..],
        [crate::edge::durable::JournalWrite::Finish { epoch: 2, .. }]
    ));
}

#[test]
fn r_cont_1_a_lost_adoption_is_continued_on_the_pool_when_the_route_opts_in() {
    let key = iop_wire::RunKey {
        generation: 3,
        run_id: 101,
    };
    let mut spec = parkable_spec();
    spec.continuation = true;
    // Without the answer so far, a lost adoption is not continued.
    let mut r = Request::adopting(t(0), spec.clone(), &offer(key, 5), 4, 3, None);
    drain(&mut r);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Rejected(AdmitRejection::NoRoute)),
    );
    let outs = drain(&mut r);
    assert!(
        !commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_)))
    );
    let mut r = Request::adopting(t(0), spec, &offer(key, 5), 4, 3, Some(&resumed("Hel", 4)));
    drain(&mut r);
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Rejected(AdmitRejection::NoRoute)),
    );
    let outs = drain(&mut r);
    assert!(
        commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(d) if d.allow_avoided_fallback)),
        "{outs:?}"
    );
    assert!(journal_writes(&outs).is_empty(), "not ended");
}

fn refusal(kind: crate::tenant::RefusalKind, retry_after_ms: Option<u64>) -> AttemptRefusal {
    AttemptRefusal {
        refusal: crate::tenant::Refusal {
            kind,
            subject: crate::tenant::Subject::Principal("team".into()),
            meter: Some(crate::tenant::Meter::Spend),
            retry_after_ms,
            claim_pending: false,
        },
        claim_pending: false,
    }
}

#[test]
fn r_ten_2_a_failover_reserves_again_before_it_is_admitted() {
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::StreamEnded);
    let outs = drain_outputs(&mut r);
    assert!(
        outs.contains(&RequestOutput::ReserveAttempt {
            attempt: 2,
            extra_input_tokens_max: 0,
        }),
        "{outs:?}"
    );
    assert!(!admits(&outs), "no admission before the reservation");
    assert_eq!(r.phase(), RequestPhase::Queued);
    // Reserved: the attempt is admitted, avoiding the failed provider.
    r.handle_input(t(3), RequestInput::AttemptReserved);
    let admit = commands(&drain_outputs(&mut r))
        .into_iter()
        .find_map(|c| match c {
            RequestCommand::Admit(d) => Some(d),
            _ => None,
        })
        .expect("admitted once reserved");
    assert_eq!(admit.avoid_provider_id, Some(ProviderId::from("p0")));
    // A second answer changes nothing.
    r.handle_input(t(3), RequestInput::AttemptReserved);
    assert!(drain_outputs(&mut r).is_empty());
}

#[test]
fn r_ten_2_a_failover_whose_reservation_is_refused_ends_with_the_tenants_429_and_no_provider_call()
{
    use crate::tenant::RefusalKind;
    for kind in [RefusalKind::InsufficientQuota, RefusalKind::RateLimited] {
        let mut r = Request::new(t(0), spec(None, &[]));
        let l = lease(1, "p0", AdapterKind::Mock);
        running(&mut r, &l);
        r.handle_input(t(2), RequestInput::StreamEnded);
        drain_outputs(&mut r);
        r.handle_input(
            t(3),
            RequestInput::AttemptRefused(refusal(kind, Some(1_500))),
        );
        let outs = drain_outputs(&mut r);
        assert!(!admits(&outs), "no admission: {outs:?}");
        assert!(
            !outs.iter().any(|o| matches!(o, RequestOutput::Open { .. })),
            "no provider call"
        );
        let failure = AdmissionFailure::Tenant {
            kind,
            retry_after_ms: Some(1_500),
        };
        assert_eq!(
            deliveries(&outs),
            vec![Delivery::Fail {
                kind: GateFailure::Admission(failure),
                in_stream: false,
                provider: None,
            }]
        );
        assert!(observations(&outs).contains(&RequestObservation::AdmissionFailed(failure)));
        assert!(r.is_ended());
        assert_eq!(r.gate().attempts(), 1);
        assert_eq!(
            GateFailure::parse(GateFailure::Admission(failure).as_str()),
            Some(GateFailure::Admission(AdmissionFailure::Tenant {
                kind,
                retry_after_ms: None
            })),
            "a record keeps the refusal by name"
        );
    }
}

#[test]
fn r_ten_2_a_continuation_reserves_the_answer_so_far_as_input_and_a_refusal_ends_in_the_stream() {
    use crate::tenant::RefusalKind;
    let mut r = Request::new(t(0), continuing_spec());
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("tok0")));
    r.handle_input(t(3), run(text(" tok1")));
    drain_outputs(&mut r);
    r.handle_input(
        t(5),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    let outs = drain_outputs(&mut r);
    assert!(
        outs.contains(&RequestOutput::ReserveAttempt {
            attempt: 2,
            extra_input_tokens_max: "tok0 tok1".len() as u64,
        }),
        "{outs:?}"
    );
    assert!(!admits(&outs));
    r.handle_input(
        t(6),
        RequestInput::AttemptRefused(refusal(RefusalKind::RateLimited, None)),
    );
    let outs = drain_outputs(&mut r);
    assert_eq!(
        deliveries(&outs),
        vec![Delivery::Fail {
            kind: GateFailure::Admission(AdmissionFailure::Tenant {
                kind: RefusalKind::RateLimited,
                retry_after_ms: None,
            }),
            in_stream: true,
            provider: None,
        }]
    );
    assert!(!admits(&outs));
    assert!(r.is_ended());
}

#[test]
fn r_ten_2_a_reservation_answered_after_the_client_left_changes_nothing() {
    use crate::tenant::RefusalKind;
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::StreamEnded);
    drain_outputs(&mut r);
    r.handle_input(t(3), RequestInput::ClientDisconnected);
    let outs = drain_outputs(&mut r);
    assert!(deliveries(&outs).is_empty());
    assert!(r.is_ended());
    r.handle_input(t(4), RequestInput::AttemptReserved);
    r.handle_input(
        t(4),
        RequestInput::AttemptRefused(refusal(RefusalKind::InsufficientQuota, None)),
    );
    assert!(drain_outputs(&mut r).is_empty());
}

#[test]
fn r_ten_2_the_first_attempt_reserves_nothing_beyond_its_admission() {
    let mut r = Request::new(t(0), spec(None, &[]));
    assert!(
        !drain_outputs(&mut r)
            .iter()
            .any(|o| matches!(o, RequestOutput::ReserveAttempt { .. })),
        "the first attempt's reservation is the admission's"
    );
}

#[test]
fn r_ten_2_an_attempt_waiting_for_a_claim_on_its_way_asks_again_then_is_admitted() {
    use crate::tenant::RefusalKind;
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::StreamEnded);
    drain_outputs(&mut r);
    let pending = AttemptRefusal {
        claim_pending: true,
        ..refusal(RefusalKind::InsufficientQuota, Some(1_000))
    };
    r.handle_input(t(3), RequestInput::AttemptRefused(pending.clone()));
    assert!(
        drain_outputs(&mut r).is_empty(),
        "no terminal, no admission"
    );
    assert_eq!(r.poll_timeout(), Some(t(3) + RESERVE_RETRY));
    r.handle_timeout(t(3) + RESERVE_RETRY);
    let outs = drain_outputs(&mut r);
    assert_eq!(
        outs,
        vec![RequestOutput::ReserveAttempt {
            attempt: 2,
            extra_input_tokens_max: 0,
        }],
        "asked again"
    );
    r.handle_input(t(60), RequestInput::AttemptReserved);
    assert!(admits(&drain_outputs(&mut r)));
}

#[test]
fn r_ten_2_an_attempt_still_short_after_its_last_ask_ends_with_the_tenants_429() {
    use crate::tenant::RefusalKind;
    let mut r = Request::new(t(0), spec(None, &[]));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), RequestInput::StreamEnded);
    drain_outputs(&mut r);
    let pending = AttemptRefusal {
        claim_pending: true,
        ..refusal(RefusalKind::InsufficientQuota, Some(1_000))
    };
    let mut now = t(3);
    let mut asks = 1;
    loop {
        r.handle_input(now, RequestInput::AttemptRefused(pending.clone()));
        let outs = drain_outputs(&mut r);
        if !deliveries(&outs).is_empty() {
            assert!(matches!(
                deliveries(&outs)[..],
                [Delivery::Fail {
                    kind: GateFailure::Admission(AdmissionFailure::Tenant {
                        kind: RefusalKind::InsufficientQuota,
                        ..
                    }),
                    in_stream: false,
                    ..
                }]
            ));
            break;
        }
        now = now.saturating_add(RESERVE_RETRY);
        r.handle_timeout(now);
        assert_eq!(drain_outputs(&mut r).len(), 1, "asked again");
        asks += 1;
    }
    assert_eq!(asks, MAX_RESERVE_ASKS);
    assert!(r.is_ended());
    assert!(!admits(&drain_outputs(&mut r)));
}

fn metered_spec(continuation: bool) -> RequestSpec {
    let mut s = spec(None, &[]);
    s.continuation = continuation;
    s.prompt_tokens = 100;
    s
}

fn unmetered(input: u64, output: u64) -> Unmetered {
    Unmetered { input, output }
}

#[test]
fn r_ten_2_a_cut_attempts_prompt_is_charged_once_per_attempt_its_provider_accepted() {
    let mut r = Request::new(t(0), metered_spec(true));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    assert_eq!(r.unmetered(), unmetered(0, 0), "sent, not yet accepted");
    r.handle_input(
        t(2),
        run(RunEventKind::Started {
            session_id: "s".into(),
        }),
    );
    assert_eq!(r.unmetered(), unmetered(100, 0), "its provider read it");
    // Nine characters, then the node is lost: continued elsewhere.
    r.handle_input(t(3), run(text("tok0 tok1")));
    r.handle_input(
        t(5),
        RequestInput::Dispatch(RequestEvent::LeaseFenced(l.clone())),
    );
    drain(&mut r);
    assert_eq!(r.unmetered(), unmetered(100, 3), "the cut attempt, once");
    let l2 = lease(2, "p1", AdapterKind::Mock);
    reopen(&mut r, &l2);
    assert_eq!(r.unmetered(), unmetered(100, 3), "not accepted yet");
    // Accepted: it sent the prompt and the answer so far (9 bytes).
    r.handle_input(t(22), run(text(" tok2")));
    assert_eq!(r.unmetered(), unmetered(100 + 100 + 9, 3 + 2));
    // Its own report covers it; never the cut one's.
    r.handle_input(
        t(23),
        run(RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(Usage::tokens(109, 2)),
        }),
    );
    r.handle_input(
        t(24),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l2.lease_id,
            verdict: applied(&l2),
        }),
    );
    drain(&mut r);
    assert!(r.is_ended());
    assert_eq!(r.unmetered(), unmetered(100, 3));
    assert_eq!(
        TokenUse::settled(
            Some(TokenUse::of_usage(&Usage::tokens(109, 2))),
            r.unmetered()
        ),
        Some(TokenUse {
            input: 209,
            output: 5,
            ..TokenUse::default()
        })
    );
}

#[test]
fn r_ten_2_a_failover_charges_the_prompt_of_an_accepted_attempt_never_of_a_refused_one() {
    let mut r = Request::new(t(0), metered_spec(false));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    // Accepted, then lost before any content: it fails over.
    r.handle_input(
        t(2),
        run(RunEventKind::Started {
            session_id: "s".into(),
        }),
    );
    r.handle_input(t(3), RequestInput::StreamEnded);
    let outs = drain(&mut r);
    assert!(admits(&outs), "{outs:?}");
    assert_eq!(r.unmetered(), unmetered(100, 0));
    // The next one is lost before its provider accepted it.
    let l2 = lease(2, "p1", AdapterKind::Mock);
    reopen(&mut r, &l2);
    r.handle_input(t(22), RequestInput::StreamEnded);
    drain(&mut r);
    assert_eq!(r.unmetered(), unmetered(100, 0), "once, the first only");
    // A tunnel's error head is a refusal; its success head an acceptance.
    for (status, accepted) in [(200, true), (204, true), (503, false), (429, false)] {
        let head = NodeFrame::Tunnel(ProviderTunnelFrame::Head {
            status,
            headers: Vec::new(),
        });
        assert_eq!(super::provider_accepted(&head), accepted, "{status}");
    }
    let failed = NodeFrame::Run(RunEventKind::Failed(ExecutionFailure::new(
        FailureCode::ProviderError,
    )));
    assert!(!super::provider_accepted(&failed));
}

#[test]
fn r_ten_2_an_answer_cut_by_its_client_leaving_is_charged_its_prompt_and_text() {
    let mut r = Request::new(t(0), metered_spec(false));
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("Hello, wor")));
    r.handle_input(t(3), RequestInput::ClientDisconnected);
    drain(&mut r);
    assert!(r.is_ended());
    assert_eq!(r.unmetered(), unmetered(100, 3));
    assert_eq!(
        TokenUse::settled(None, r.unmetered()),
        Some(TokenUse {
            input: 100,
            output: 3,
            ..TokenUse::default()
        })
    );
}

#[test]
fn r_ten_2_a_takeover_charges_the_former_attempts_prompt_only_when_no_usage_covers_it() {
    let mut spec = durable_spec();
    spec.continuation = true;
    spec.prompt_tokens = 100;
    let mut unreported = resumed("Hello, wor", 6);
    unreported.usage = None;
    let r = Request::continuing(t(0), spec.clone(), &unreported);
    assert_eq!(r.unmetered(), unmetered(100, 3), "the dead Edge's attempt");
    let r = Request::continuing(t(0), spec, &resumed("Hello, wor", 6));
    assert_eq!(
        r.unmetered(),
        unmetered(0, 0),
        "its usage reached the journal"
    );
    // An adopted run is an accepted attempt: lost without a report, its
    // prompt and all its text are charged; its report covers both.
    let key = iop_wire::RunKey {
        generation: 3,
        run_id: 101,
    };
    let mut spec = parkable_spec();
    spec.prompt_tokens = 100;
    let mut unreported = resumed("Hello", 4);
    unreported.usage = None;
    let r = Request::adopting(t(0), spec.clone(), &offer(key, 5), 4, 3, Some(&unreported));
    assert_eq!(r.unmetered(), unmetered(100, 2), "until the run reports");
    let r = Request::adopting(t(0), spec, &offer(key, 5), 4, 3, Some(&resumed("Hello", 4)));
    assert_eq!(r.unmetered(), unmetered(0, 0), "its usage so far covers it");
}

#[test]
fn r_ten_2_a_lost_adoption_on_a_route_that_does_not_continue_is_charged_the_text_before_it() {
    let key = iop_wire::RunKey {
        generation: 3,
        run_id: 101,
    };
    let mut spec = parkable_spec();
    spec.continuation = false;
    spec.prompt_tokens = 100;
    let mut before = resumed("Hello, wor", 4);
    before.usage = None;
    let mut r = Request::adopting(t(0), spec, &offer(key, 5), 4, 3, Some(&before));
    drain(&mut r);
    // The run is lost: never continued (the route does not), the answer
    // ends, charged its prompt and the text before the adoption.
    r.handle_input(
        t(1),
        RequestInput::Dispatch(RequestEvent::Rejected(AdmitRejection::NoRoute)),
    );
    let outs = drain(&mut r);
    assert!(
        !commands(&outs)
            .iter()
            .any(|c| matches!(c, RequestCommand::Admit(_))),
        "{outs:?}"
    );
    assert_eq!(r.unmetered(), unmetered(100, 3));
}

#[test]
fn r_ten_2_a_request_whose_record_was_taken_charges_nothing() {
    let mut spec = durable_spec();
    spec.prompt_tokens = 100;
    let mut r = Request::new(t(0), spec);
    let l = lease(1, "p0", AdapterKind::Mock);
    running(&mut r, &l);
    r.handle_input(t(2), run(text("Hello")));
    assert_eq!(
        r.unmetered(),
        unmetered(100, 2),
        "its prompt and text so far"
    );
    r.handle_input(
        t(3),
        RequestInput::Journaled(JournalAck::Refused(JournalError::Fenced {
            current: 2,
            writer: 1,
        })),
    );
    drain(&mut r);
    assert_eq!(
        r.unmetered(),
        unmetered(0, 0),
        "the Edge that took it charges"
    );
}

/// A tunnel request of prompt 100 running on p0, its success head with
/// `content_type` taken.
fn tunnel_running(api: TunnelApi, content_type: &str) -> (Request, Lease) {
    let mut s = single(spec(Some(api), &["p0"]));
    s.prompt_tokens = 100;
    let mut r = Request::new(t(0), s);
    let adapter = match api {
        TunnelApi::OpenAi => AdapterKind::OpenAi,
        TunnelApi::Messages => AdapterKind::Anthropic,
        TunnelApi::Ollama => AdapterKind::Ollama,
    };
    let l = lease(1, "p0", adapter);
    running(&mut r, &l);
    r.handle_input(
        t(2),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Head {
            status: 200,
            headers: vec![("Content-Type".to_owned(), content_type.to_owned())],
        })),
    );
    (r, l)
}

fn tunnel_body(r: &mut Request, at: u64, bytes: &str) {
    r.handle_input(
        t(at),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Body(
            bytes.as_bytes().to_vec(),
        ))),
    );
}

fn tunnel_end(r: &mut Request, l: &Lease) {
    r.handle_input(
        t(20),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::End)),
    );
    r.handle_input(
        t(21),
        RequestInput::Dispatch(RequestEvent::Terminal {
            lease_id: l.lease_id,
            verdict: applied(l),
        }),
    );
    drain(r);
    assert!(r.is_ended());
}

#[test]
fn r_ten_2_a_tunnelled_answer_settles_with_the_usage_its_provider_reported_in_its_bytes() {
    let (mut r, l) = tunnel_running(TunnelApi::OpenAi, "text/event-stream");
    tunnel_body(
        &mut r,
        3,
        "data: {\"choices\":[{\"delta\":{\"content\":\"Hello there\"}}],\"usage\":null}\n\n",
    );
    assert_eq!(r.relayed_usage(), None, "not reported yet");
    assert_eq!(
        r.unmetered(),
        unmetered(100, 3),
        "so far: its prompt and text"
    );
    tunnel_body(
        &mut r,
        4,
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":31,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
    );
    tunnel_end(&mut r, &l);
    assert_eq!(r.relayed_usage(), Some(Usage::tokens(31, 2)));
    assert_eq!(
        r.unmetered(),
        unmetered(0, 0),
        "the report replaces the estimates"
    );
}

#[test]
fn r_ten_2_a_tunnelled_answer_without_a_report_is_charged_its_prompt_and_text_estimated() {
    let (mut r, l) = tunnel_running(TunnelApi::OpenAi, "text/event-stream");
    tunnel_body(
        &mut r,
        3,
        "data: {\"choices\":[{\"delta\":{\"content\":\"abcdefghijkl\"}}]}\n\ndata: [DONE]\n\n",
    );
    tunnel_end(&mut r, &l);
    assert_eq!(r.relayed_usage(), None);
    assert_eq!(r.unmetered(), unmetered(100, 3));
}

#[test]
fn r_ten_2_a_cut_messages_tunnel_is_charged_the_prompt_its_provider_counted() {
    let (mut r, _) = tunnel_running(TunnelApi::Messages, "text/event-stream");
    tunnel_body(
        &mut r,
        3,
        concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":",
            "{\"input_tokens\":30,\"cache_read_input_tokens\":10,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",",
            "\"delta\":{\"type\":\"text_delta\",\"text\":\"12345678\"}}\n\n"
        ),
    );
    // The node is lost mid-answer: a tunnel is never continued.
    r.handle_input(t(5), RequestInput::StreamEnded);
    drain(&mut r);
    assert!(r.is_ended());
    assert_eq!(r.relayed_usage(), None);
    assert_eq!(r.unmetered(), unmetered(40, 2));
}

#[test]
fn r_ten_2_a_tunnel_s_error_answer_is_not_read_as_usage() {
    let mut s = single(spec(Some(TunnelApi::OpenAi), &["p0"]));
    s.prompt_tokens = 100;
    let mut r = Request::new(t(0), s);
    let l = lease(1, "p0", AdapterKind::OpenAi);
    running(&mut r, &l);
    r.handle_input(
        t(2),
        RequestInput::Frame(NodeFrame::Tunnel(ProviderTunnelFrame::Head {
            status: 400,
            headers: vec![("content-type".to_owned(), "application/json".to_owned())],
        })),
    );
    tunnel_body(
        &mut r,
        3,
        "{\"error\":{\"message\":\"bad\"},\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":5}}",
    );
    tunnel_end(&mut r, &l);
    assert_eq!(r.relayed_usage(), None);
    assert_eq!(
        r.unmetered(),
        unmetered(0, 0),
        "refused: nothing read, nothing made"
    );
}
