use std::time::Duration;

use super::*;

const A: SourceAddr = SourceAddr([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1]);
const B: SourceAddr = SourceAddr([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2]);
const T0: Instant = Instant::from_millis(1_000);

/// One microsecond before `at`: the last moment a deadline has not passed.
fn before(at: Instant) -> Instant {
    Instant::from_micros(at.as_micros() - 1)
}

/// Nothing happens one microsecond before `deadline`; at it, `step`.
fn fires_at(c: &mut Connections, id: ConnId, deadline: Instant, step: ConnStep) {
    assert_eq!(c.handle_timeout(id, before(deadline)), ConnStep::Wait);
    assert_eq!(c.handle_timeout(id, deadline), step);
}

/// Distinct durations, so a test can tell which one a deadline came from.
fn limits(cap: usize, share: usize) -> ConnLimits {
    ConnLimits {
        first_request_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(5),
        max_age: Duration::from_secs(60),
        age_grace: Duration::from_secs(7),
        max_connections: cap,
        max_connections_per_source: share,
    }
}

#[track_caller]
fn admitted(c: &mut Connections, source: SourceAddr, now: Instant) -> (ConnId, Option<ConnId>) {
    match c.admit(source, now) {
        ConnAdmission::Admitted { id, evict } => (id, evict),
        ConnAdmission::Refused(by) => panic!("refused by {by:?}"),
    }
}

/// Admitted with nobody evicted.
#[track_caller]
fn fresh(c: &mut Connections, source: SourceAddr) -> ConnId {
    let (id, evict) = admitted(c, source, T0);
    assert_eq!(evict, None);
    id
}

/// One request started and ended on `id` at `at`.
fn serve_one(c: &mut Connections, id: ConnId, at: Instant) {
    c.request_started(id);
    c.request_ended(id, at);
}

fn counted_of(c: &Connections, source: SourceAddr) -> usize {
    c.per_source.get(&source).copied().unwrap_or(0)
}

// ---- R-LIM-1: admission ----

#[test]
fn r_lim_1_one_under_the_cap_a_newcomer_is_admitted_without_evicting() {
    let mut c = Connections::new(limits(3, 3));
    fresh(&mut c, A);
    fresh(&mut c, B);
    // The third fills the cap exactly: nobody is evicted for it.
    fresh(&mut c, A);
    assert_eq!(c.counted, 3);
    assert_eq!(c.conns.len(), 3);
}

#[test]
fn r_lim_1_at_the_cap_the_oldest_connection_that_never_sent_a_request_makes_room() {
    // A newcomer is never left waiting: idle holders make room.
    let mut c = Connections::new(limits(3, 3));
    let kept_alive = fresh(&mut c, A);
    serve_one(&mut c, kept_alive, T0);
    let silent = fresh(&mut c, B);
    let silent_too = fresh(&mut c, A);
    // The never-served one goes first although the kept-alive one is older,
    // and of two never-served ones the older.
    let (newcomer, evict) = admitted(&mut c, B, T0);
    assert_eq!(evict, Some(silent));
    assert_eq!(c.counted, 3);
    let (_, evict) = admitted(&mut c, B, T0);
    assert_eq!(evict, Some(silent_too));
    // Then the idle keep-alive one; never a busy one.
    c.request_started(newcomer);
    let newest = c.conns.keys().copied().max().unwrap();
    c.request_started(newest);
    let (_, evict) = admitted(&mut c, A, T0);
    assert_eq!(evict, Some(kept_alive));
    assert_eq!(c.counted, 3);
}

#[test]
fn r_lim_1_when_every_connection_is_busy_a_newcomer_is_refused() {
    let mut c = Connections::new(limits(2, 2));
    let a = fresh(&mut c, A);
    let b = fresh(&mut c, B);
    c.request_started(a);
    c.request_started(b);
    let before = c.clone();
    assert_eq!(c.admit(A, T0), ConnAdmission::Refused(RefusedBy::Cap));
    assert_eq!(c.admit(B, T0), ConnAdmission::Refused(RefusedBy::Cap));
    assert_eq!(c.conns, before.conns, "a refusal changes nothing");
    assert_eq!(c.counted, 2);
    // One request ends: that connection may now make room.
    c.request_ended(b, T0);
    let (_, evict) = admitted(&mut c, A, T0);
    assert_eq!(evict, Some(b));
}

#[test]
fn r_lim_1_one_source_cannot_take_more_than_its_share() {
    let mut c = Connections::new(limits(10, 2));
    let a1 = fresh(&mut c, A);
    // One under the share: admitted without evicting.
    let a2 = fresh(&mut c, A);
    c.request_started(a1);
    let b = fresh(&mut c, B);
    // At its share, A displaces its own idle connection, not B's (which is
    // older than the newcomer and idle too), though the cap is far.
    let (a3, evict) = admitted(&mut c, A, T0);
    assert_eq!(evict, Some(a2));
    assert_eq!(counted_of(&c, A), 2);
    assert_eq!(counted_of(&c, B), 1);
    // With both of A's busy, A is refused while B still gets in.
    c.request_started(a3);
    assert_eq!(
        c.admit(A, T0),
        ConnAdmission::Refused(RefusedBy::SourceShare)
    );
    let (_, evict) = admitted(&mut c, B, T0);
    assert_eq!(evict, None);
    assert!(c.conns.contains_key(&b));
}

#[test]
fn r_lim_1_over_its_share_a_source_never_evicts_another_sources_connection() {
    let mut c = Connections::new(limits(10, 1));
    let b = fresh(&mut c, B);
    let a = fresh(&mut c, A);
    c.request_started(a);
    // B's idle connection is the only idle one; A may not take it.
    assert_eq!(
        c.admit(A, T0),
        ConnAdmission::Refused(RefusedBy::SourceShare)
    );
    assert!(!c.conns[&b].evicted);
}

#[test]
fn r_lim_1_an_evicted_connection_no_longer_counts_and_is_never_chosen_twice() {
    let mut c = Connections::new(limits(2, 2));
    let a = fresh(&mut c, A);
    let b = fresh(&mut c, B);
    let (x, evict) = admitted(&mut c, A, T0);
    assert_eq!(evict, Some(a));
    // Still open until its task closes it, but counted no more.
    assert!(c.conns[&a].evicted);
    assert_eq!(c.counted, 2);
    assert_eq!(counted_of(&c, A), 1);
    // The next newcomer evicts another, not `a` again.
    let (_, evict) = admitted(&mut c, A, T0);
    assert_eq!(evict, Some(b));
    // Closing an evicted connection frees nothing twice.
    c.closed(a);
    c.closed(b);
    assert_eq!(c.counted, 2);
    assert_eq!(counted_of(&c, A), 2);
    assert_eq!(counted_of(&c, B), 0);
    assert!(!c.per_source.contains_key(&B), "no zero entries");
    // Closing a counted one frees its place.
    c.closed(x);
    assert_eq!(c.counted, 1);
    fresh(&mut c, B);
}

#[test]
fn r_lim_1_ids_are_unique_and_increasing_and_unknown_ids_are_ignored() {
    let mut c = Connections::new(limits(1, 1));
    let first = fresh(&mut c, A);
    c.closed(first);
    let second = fresh(&mut c, A);
    assert!(second > first);
    assert_eq!(second.as_u64(), first.as_u64() + 1);
    let before = c.clone();
    c.request_started(first);
    c.closed(first);
    assert_eq!(c.poll_timeout(first), None);
    assert_eq!(c.handle_timeout(first, Instant::MAX), ConnStep::Wait);
    assert_eq!(c.handle_eviction(first), ConnStep::Wait);
    assert_eq!(c.handle_stop(first), ConnStep::Wait);
    assert!(!c.is_draining(first));
    assert_eq!(c.conns, before.conns);
    assert_eq!(c.counted, 1);
}

// ---- R-LIM-1: idleness ----

#[test]
fn r_lim_1_before_its_first_request_a_connection_has_the_first_request_timeout() {
    let l = limits(2, 2);
    let mut c = Connections::new(l);
    let id = fresh(&mut c, A);
    let deadline = T0 + l.first_request_timeout;
    assert_eq!(c.poll_timeout(id), Some(deadline));
    fires_at(&mut c, id, deadline, ConnStep::Close(CloseReason::Idle));
}

#[test]
fn r_lim_1_after_a_request_ended_the_idle_timeout_runs_from_its_end() {
    let l = limits(2, 2);
    let mut c = Connections::new(l);
    let id = fresh(&mut c, A);
    c.request_started(id);
    // Busy: no idle deadline, only the age.
    assert_eq!(c.poll_timeout(id), Some(T0 + l.max_age));
    let first = T0 + l.first_request_timeout;
    assert_eq!(c.handle_timeout(id, first + l.idle_timeout), ConnStep::Wait);
    let ended = T0 + Duration::from_secs(9);
    c.request_ended(id, ended);
    // The idle timeout now, not the first-request one, from the end.
    let deadline = ended + l.idle_timeout;
    assert_eq!(c.poll_timeout(id), Some(deadline));
    fires_at(&mut c, id, deadline, ConnStep::Close(CloseReason::Idle));
}

#[test]
fn r_lim_1_with_several_requests_in_flight_it_is_idle_only_after_the_last_ends() {
    // HTTP/2: streams on one connection.
    let l = limits(1, 1);
    let mut c = Connections::new(l);
    let id = fresh(&mut c, A);
    c.request_started(id);
    c.request_started(id);
    c.request_ended(id, T0 + Duration::from_secs(1));
    assert_eq!(c.poll_timeout(id), Some(T0 + l.max_age), "still busy");
    assert_eq!(
        c.admit(B, T0),
        ConnAdmission::Refused(RefusedBy::Cap),
        "and never a victim"
    );
    let last = T0 + Duration::from_secs(3);
    c.request_ended(id, last);
    assert_eq!(c.poll_timeout(id), Some(last + l.idle_timeout));
}

// ---- R-LIM-1: age ----

#[test]
fn r_lim_1_a_connection_drains_at_its_age_and_closes_at_age_plus_grace() {
    let l = limits(2, 2);
    let mut c = Connections::new(l);
    let id = fresh(&mut c, A);
    c.request_started(id);
    let age = T0 + l.max_age;
    assert_eq!(c.handle_timeout(id, before(age)), ConnStep::Wait);
    assert!(!c.is_draining(id));
    assert_eq!(c.handle_timeout(id, age), ConnStep::Drain);
    assert!(c.is_draining(id));
    // Drain is answered once; then only the hard close is left.
    let close = age + l.age_grace;
    assert_eq!(c.poll_timeout(id), Some(close));
    fires_at(&mut c, id, close, ConnStep::Close(CloseReason::MaxAge));
}

#[test]
fn r_lim_1_a_draining_connection_is_not_closed_for_idleness() {
    let l = limits(2, 2);
    let mut c = Connections::new(l);
    let id = fresh(&mut c, A);
    assert_eq!(c.handle_stop(id), ConnStep::Drain);
    assert_eq!(c.handle_stop(id), ConnStep::Wait, "drain is answered once");
    let idle = T0 + l.first_request_timeout;
    assert_eq!(c.handle_timeout(id, idle), ConnStep::Wait);
    assert_eq!(c.poll_timeout(id), Some(T0 + l.max_age + l.age_grace));
}

#[test]
fn r_lim_1_an_idle_connection_whose_age_comes_first_drains_at_its_age() {
    let l = ConnLimits {
        max_age: Duration::from_secs(1),
        ..limits(2, 2)
    };
    let mut c = Connections::new(l);
    let id = fresh(&mut c, A);
    let age = T0 + l.max_age;
    assert!(age < T0 + l.first_request_timeout);
    assert_eq!(c.poll_timeout(id), Some(age));
    assert_eq!(c.handle_timeout(id, age), ConnStep::Drain);
}

#[test]
fn r_lim_1_past_both_deadlines_the_age_rule_answers_first() {
    let l = limits(2, 2);
    let mut c = Connections::new(l);
    let id = fresh(&mut c, A);
    let late = T0 + l.max_age + l.first_request_timeout;
    assert_eq!(c.handle_timeout(id, late), ConnStep::Drain);
}

// ---- R-LIM-1: eviction ----

#[test]
fn r_lim_1_an_evicted_idle_connection_closes() {
    let mut c = Connections::new(limits(1, 1));
    let old = fresh(&mut c, A);
    let (_, evict) = admitted(&mut c, B, T0);
    assert_eq!(evict, Some(old));
    assert_eq!(
        c.handle_eviction(old),
        ConnStep::Close(CloseReason::Evicted)
    );
}

#[test]
fn r_lim_1_an_evicted_connection_that_became_busy_drains_instead_of_closing() {
    let l = limits(1, 1);
    let mut c = Connections::new(l);
    let old = fresh(&mut c, A);
    let (_, evict) = admitted(&mut c, B, T0);
    assert_eq!(evict, Some(old));
    // A request started before its task heard of the eviction.
    c.request_started(old);
    assert_eq!(c.handle_eviction(old), ConnStep::Drain);
    assert_eq!(
        c.handle_eviction(old),
        ConnStep::Wait,
        "drain is answered once"
    );
    assert_eq!(c.poll_timeout(old), Some(T0 + l.max_age + l.age_grace));
    // Already draining for shutdown, then evicted while busy: still a wait.
    let mut c = Connections::new(l);
    let old = fresh(&mut c, A);
    c.request_started(old);
    assert_eq!(c.handle_stop(old), ConnStep::Drain);
    c.request_ended(old, T0);
    admitted(&mut c, B, T0);
    c.request_started(old);
    assert_eq!(c.handle_eviction(old), ConnStep::Wait);
    // Idle again: an evicted connection closes even while draining.
    c.request_ended(old, T0);
    assert_eq!(
        c.handle_eviction(old),
        ConnStep::Close(CloseReason::Evicted)
    );
}

#[test]
fn r_lim_1_a_connection_that_was_not_evicted_ignores_an_eviction() {
    let mut c = Connections::new(limits(2, 2));
    let id = fresh(&mut c, A);
    assert_eq!(c.handle_eviction(id), ConnStep::Wait);
    assert!(!c.is_draining(id));
}

#[test]
fn the_close_reasons_have_stable_names() {
    assert_eq!(CloseReason::Idle.as_str(), "idle");
    assert_eq!(CloseReason::Evicted.as_str(), "evicted");
    assert_eq!(CloseReason::MaxAge.as_str(), "max_age");
}

// ---- R-LIM-2 ----

const D: usize = DECODED_BYTES_PER_BODY_BYTE;

#[test]
fn r_lim_2_a_declared_length_over_the_limit_is_refused_before_reading() {
    let rule = BodyRule::new(10);
    let too_large = Err(BodyRefusal::TooLarge { limit_bytes: 10 });
    assert_eq!(rule.before_read(Some(11)), too_large);
    assert_eq!(rule.before_read(Some(u64::MAX)), too_large);
    // Exactly the limit is allowed, and taken at the decoded rate.
    assert_eq!(rule.before_read(Some(10)), Ok(10 * D));
    assert_eq!(rule.before_read(Some(0)), Ok(0));
    // No length declared: taken as the bytes arrive.
    assert_eq!(rule.before_read(None), Ok(0));
}

#[test]
fn r_lim_2_while_reading_a_body_is_accounted_at_the_decoded_rate() {
    let rule = BodyRule::new(10);
    assert_eq!(rule.while_reading(0), 0);
    assert_eq!(rule.while_reading(3), 3 * D);
    assert_eq!(rule.while_reading(usize::MAX), usize::MAX, "saturates");
}

#[test]
fn r_lim_2_once_read_a_json_body_holds_its_decoded_tree_and_itself() {
    let rule = BodyRule::new(10);
    assert_eq!(rule.most_decoded_bytes(), 10 * D);
    // Text: far less than the rate it was read at.
    assert_eq!(rule.once_read(10, Some(30)), Ok(40));
    // Small objects in bulk: more than the rate, up to the largest body's.
    assert_eq!(rule.once_read(5, Some(10 * D - 5)), Ok(10 * D));
    assert_eq!(
        rule.once_read(5, Some(10 * D - 4)),
        Err(BodyRefusal::TooComplex {
            decoded_bytes: 10 * D + 1,
            limit_bytes: 10 * D
        })
    );
    assert_eq!(
        rule.once_read(1, Some(usize::MAX)),
        Err(BodyRefusal::TooComplex {
            decoded_bytes: usize::MAX,
            limit_bytes: 10 * D
        })
    );
}

#[test]
fn r_lim_2_once_read_a_body_that_is_not_json_stays_accounted_as_read() {
    let rule = BodyRule::new(10);
    assert_eq!(rule.once_read(8, None), Ok(8 * D));
    // The largest body is exactly the most one may take.
    assert_eq!(rule.once_read(10, None), Ok(10 * D));
    assert_eq!(rule.once_read(0, None), Ok(0));
}

#[test]
fn r_lim_2_a_parsed_request_keeps_less_than_it_held_while_read() {
    assert_eq!(kept_bytes(8), 8 * KEPT_BYTES_PER_BODY_BYTE);
    assert_eq!(kept_bytes(usize::MAX), usize::MAX);
    const { assert!(KEPT_BYTES_PER_BODY_BYTE < DECODED_BYTES_PER_BODY_BYTE) };
}

#[test]
fn r_lim_2_refusals_name_the_limit() {
    assert_eq!(
        BodyRefusal::TooLarge { limit_bytes: 10 }.to_string(),
        "request body larger than 10 bytes"
    );
    assert_eq!(
        BodyRefusal::TooComplex {
            decoded_bytes: 161,
            limit_bytes: 160
        }
        .to_string(),
        "request body decodes to 161 bytes, over 160"
    );
}
