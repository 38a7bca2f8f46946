//! Tenants' limits and budgets, step by step with a manual clock, and as
//! properties over many Edges sharing one counter store.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

// The sibling test modules take these from here too.
use super::test_world::{Step, World, step};
pub(super) use super::test_world::{Store, T0, at};

fn request(ticket: u64, key: &str, principal: &str, unix_ms: u64) -> AdmitRequest {
    super::test_world::request(ticket, key, principal, "m", unix_ms)
}

fn rpm(limit: u64) -> Limits {
    Limits {
        requests_per_minute: Some(limit),
        ..Limits::default()
    }
}

#[test]
fn r_ten_1_a_key_at_its_requests_per_minute_is_refused_until_the_window_resets() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let mut admitted = 0;
    for i in 0..100 {
        let mut r = request(i, "k1", "p1", T0 + 1_000);
        r.key_limits = rpm(60);
        match edge.admit(at(0), &r) {
            Ok(()) => admitted += 1,
            Err(refusal) => {
                assert_eq!(refusal.kind, RefusalKind::RateLimited);
                assert_eq!(refusal.subject, Subject::Key("k1".into()));
                assert_eq!(refusal.meter, Some(Meter::Requests));
                assert_eq!(refusal.retry_after_ms, Some(59_000));
            }
        }
        store.serve(&mut edge, at(0));
    }
    assert_eq!(
        admitted, 60,
        "one Edge, the store answering: exactly the limit"
    );
    let state = edge
        .rate_state(
            &Subject::Key("k1".into()),
            Meter::Requests,
            Some(60),
            T0 + 1_000,
        )
        .unwrap();
    assert_eq!((state.remaining, state.reset_ms), (0, 59_000));
    let mut r = request(1_000, "k1", "p1", T0 + MINUTE_MS);
    r.key_limits = rpm(60);
    assert!(edge.admit(at(60_000), &r).is_ok(), "a new window");
}

#[test]
fn r_ten_1_the_tighter_of_key_and_principal_wins_and_other_principals_are_untouched() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let mut refused_on = None;
    for i in 0..10 {
        let mut r = request(i, "k1", "p1", T0);
        r.key_limits = rpm(10);
        r.principal_limits = rpm(5);
        if let Err(refusal) = edge.admit(at(0), &r) {
            refused_on.get_or_insert((i, refusal.subject));
        }
        store.serve(&mut edge, at(0));
    }
    assert_eq!(refused_on, Some((5, Subject::Principal("p1".into()))));
    // Another principal's key is admitted as if p1 did nothing.
    let mut r = request(100, "k2", "p2", T0);
    r.principal_limits = rpm(5);
    assert!(edge.admit(at(0), &r).is_ok());
}

#[test]
fn r_ten_1_requests_in_flight_are_limited_and_freed_when_settled() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let limits = Limits {
        concurrent_requests: Some(2),
        ..Limits::default()
    };
    let mut r = request(1, "k1", "p1", T0);
    r.key_limits = limits.clone();
    assert!(edge.admit(at(0), &r).is_ok());
    store.serve(&mut edge, at(0));
    r.ticket = 2;
    assert!(edge.admit(at(0), &r).is_ok());
    store.serve(&mut edge, at(0));
    r.ticket = 3;
    let refusal = edge.admit(at(0), &r).unwrap_err();
    assert_eq!(refusal.meter, None);
    assert!(!refusal.claim_pending, "the limit is reached");
    edge.settle(at(1), 1, TokenUse::default());
    store.serve(&mut edge, at(1));
    assert!(edge.admit(at(1), &r).is_ok());
    assert_eq!(edge.reservations(), 2);
}

fn priced(limit_micros: u64) -> (Limits, Price) {
    (
        Limits {
            budget: Some(Budget {
                limit_micros,
                period: Period::Total,
            }),
            ..Limits::default()
        },
        // 1 micro-unit per token.
        Price {
            input_per_mtok: 1_000_000,
            cached_input_per_mtok: 500_000,
            cache_write_per_mtok: 1_000_000,
            output_per_mtok: 1_000_000,
        },
    )
}

#[test]
fn r_ten_2_a_reservation_that_does_not_fit_is_refused_and_settling_returns_the_unused_part() {
    let mut edge = Tenants::new(TenantsConfig {
        chunk_fraction: 1.0,
        ..TenantsConfig::default()
    });
    let mut store = Store::default();
    let (limits, price) = priced(100);
    let mut r = request(1, "k1", "p1", T0);
    r.principal_limits = limits;
    r.price = Some(price);
    // Each reserves 30 (10 prompt + 20 output).
    for ticket in 1..=3 {
        r.ticket = ticket;
        assert!(edge.admit(at(0), &r).is_ok());
        store.serve(&mut edge, at(0));
    }
    r.ticket = 4;
    let refusal = edge.admit(at(0), &r).unwrap_err();
    assert_eq!(refusal.kind, RefusalKind::InsufficientQuota);
    assert_eq!(
        refusal.retry_after_ms, None,
        "a budget in total does not reset"
    );
    // Two used 12 each (10 in, 2 out): 36 back.
    for ticket in 1..=2 {
        edge.settle(
            at(1),
            ticket,
            TokenUse {
                input: 10,
                cached_input: 0,
                cache_write_input: 0,
                output: 2,
            },
        );
    }
    assert!(edge.admit(at(1), &r).is_ok(), "fits after settling");
    assert_eq!(
        TokenUse {
            input: 10,
            cached_input: 4,
            cache_write_input: 0,
            output: 1
        }
        .cost(&price),
        9,
        "cached input at its own price, rounded up"
    );
}

#[test]
fn r_ten_3_with_the_store_down_budgets_fail_closed_and_rates_take_a_local_share() {
    let mut edge = Tenants::new(TenantsConfig {
        chunk_fraction: 0.1,
        local_share: 0.5,
        ..TenantsConfig::default()
    });
    let mut store = Store {
        down: true,
        ..Store::default()
    };
    // The first claim fails: from then on the store is down.
    let (limits, price) = priced(1_000);
    let mut r = request(1, "k1", "p1", T0);
    r.principal_limits = limits;
    r.price = Some(price);
    let first = edge.admit(at(0), &r);
    store.serve(&mut edge, at(0));
    assert!(edge.store_down());
    assert!(
        first.is_ok(),
        "one chunk on credit before the store was known down"
    );
    r.ticket = 2;
    assert_eq!(
        edge.admit(at(0), &r).unwrap_err().kind,
        RefusalKind::InsufficientQuota,
        "fail closed: nothing beyond what is held"
    );
    // A rate limit: half of 10 on this Edge alone.
    let mut admitted = 0;
    for i in 10..30 {
        let mut r = request(i, "k2", "p2", T0);
        r.key_limits = rpm(10);
        admitted += u32::from(edge.admit(at(0), &r).is_ok());
        store.serve(&mut edge, at(0));
    }
    // One on credit before the failed claim told this subject the store
    // is down, then half of 10.
    assert_eq!(admitted, 6);
    // The store comes back: a refused request's claim is how the Edge
    // learns it, and the budget opens again once the claim is answered.
    store.down = false;
    r.ticket = 40;
    let refused = edge.admit(at(0), &r).unwrap_err();
    assert_eq!(
        refused.retry_after_ms,
        Some(CLAIM_RETRY_MS),
        "a claim is on its way"
    );
    store.serve(&mut edge, at(0));
    r.ticket = 41;
    assert!(edge.admit(at(0), &r).is_ok());
}

const RPM: u64 = 40;
const BUDGET: u64 = 600;

fn limits() -> Limits {
    Limits {
        requests_per_minute: Some(RPM),
        budget: Some(Budget {
            limit_micros: BUDGET,
            period: Period::Total,
        }),
        ..Limits::default()
    }
}

/// What a world did: each principal's admission decisions, the requests
/// admitted per (principal, minute), and each principal's spend.
type Outcome = (Vec<Vec<bool>>, BTreeMap<(usize, u64), u64>, [u64; 2]);

/// Run `steps` on `edges` Edges (`only`: that principal's steps alone;
/// `who` of a step is the principal).
fn world(edges: usize, steps: &[Step], only: Option<usize>) -> Outcome {
    let mut world = World::new(edges);
    let mut decisions = vec![Vec::new(), Vec::new()];
    let mut per_minute = BTreeMap::new();
    let mut spend = [0u64; 2];
    let price = Price {
        input_per_mtok: 1_000_000,
        cached_input_per_mtok: 1_000_000,
        cache_write_per_mtok: 1_000_000,
        output_per_mtok: 1_000_000,
    };
    for s in steps {
        match *s {
            Step::Admit { edge, who: p } => {
                if only.is_some_and(|o| o != p) {
                    continue;
                }
                let ok = world
                    .admit(edge, p, |ticket, unix_ms| {
                        let mut r = request(ticket, &format!("k{p}"), &format!("p{p}"), unix_ms);
                        r.principal_limits = limits();
                        r.price = Some(price);
                        r
                    })
                    .is_ok();
                decisions[p].push(ok);
                if ok {
                    *per_minute
                        .entry((p, (T0 + world.ms) / MINUTE_MS))
                        .or_default() += 1;
                }
            }
            Step::Serve { edge, fail } => world.serve(edge, fail),
            Step::Settle { edge, who: p, frac } => {
                let used = TokenUse {
                    input: 10,
                    output: 20 * frac / 8,
                    ..TokenUse::default()
                };
                if world.settle(edge, p, used) {
                    spend[p] += used.cost(&price);
                }
            }
            Step::Tick { ms } => world.tick(ms),
        }
    }
    // Everything still open ends having used its whole reservation.
    let whole = TokenUse {
        input: 10,
        output: 20,
        ..TokenUse::default()
    };
    for p in world.settle_all(whole) {
        spend[p] += whole.cost(&price);
    }
    (decisions, per_minute, spend)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// R-TEN-2, R-TEN-3: for any interleaving of up to four Edges,
    /// concurrent requests, claims answered late or failing, a window's
    /// requests and a budget's spend stay within the limit plus one chunk
    /// per Edge, plus (while the store is down) each Edge's local share of
    /// a rate.
    #[test]
    fn r_ten_2_spend_and_rates_never_exceed_the_limit_plus_edges_times_chunk(
        edges in 1..=4usize,
        steps in prop::collection::vec(step(), 1..400),
    ) {
        let (_, per_minute, spend) = world(edges, &steps, None);
        let n = edges as u64;
        let rate_chunk = (RPM as f64 * 0.1) as u64;
        let share = (RPM as f64 * 0.5) as u64;
        for ((p, minute), admitted) in &per_minute {
            prop_assert!(
                *admitted <= RPM + n * (rate_chunk + share),
                "principal {p} minute {minute}: {admitted} admitted"
            );
        }
        let spend_chunk = (BUDGET as f64 * 0.1) as u64;
        for (p, s) in spend.iter().enumerate() {
            prop_assert!(*s <= BUDGET + n * spend_chunk, "principal {p} spent {s}");
        }
    }

    /// R-TEN-1: one principal's use never changes another's admission.
    #[test]
    fn r_ten_1_one_principals_use_never_changes_anothers_admission(
        edges in 1..=4usize,
        steps in prop::collection::vec(step(), 1..300),
    ) {
        let (together, _, _) = world(edges, &steps, None);
        let (alone, _, _) = world(edges, &steps, Some(1));
        prop_assert_eq!(&together[1], &alone[1]);
    }
}

#[test]
fn r_ten_3_a_reservation_larger_than_a_chunk_claims_what_it_needs_and_fits_once_answered() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let (limits, price) = priced(1_000);
    let mut r = request(1, "k1", "p1", T0);
    r.principal_limits = limits;
    r.price = Some(price);
    r.output_tokens_max = 300;
    // 310 > one chunk (100) on credit: refused, its claim sent.
    let refusal = edge.admit(at(0), &r).unwrap_err();
    assert_eq!(refusal.retry_after_ms, Some(CLAIM_RETRY_MS));
    store.serve(&mut edge, at(1));
    assert!(
        edge.admit(at(1_000), &r).is_ok(),
        "fits once the claim is answered"
    );
}

#[test]
fn r_ten_1_a_subject_at_its_journal_bytes_gets_insufficient_quota_for_durable_requests_only() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut r = request(1, "k", "p", T0);
    r.principal_limits.journal_bytes = Some(1_000);
    r.principal_held.journal_bytes = 1_000;
    // An ephemeral request holds no journal bytes: admitted.
    assert!(edge.admit(at(0), &r).is_ok());
    r.ticket = 2;
    r.durable = true;
    let refusal = edge.admit(at(0), &r).unwrap_err();
    assert_eq!(refusal.kind, RefusalKind::InsufficientQuota);
    assert_eq!(refusal.meter, Some(Meter::JournalBytes));
    assert_eq!(refusal.subject, Subject::Principal("p".into()));
    // Another principal, holding nothing, is served.
    let mut other = request(3, "k2", "q", T0);
    other.durable = true;
    other.principal_limits.journal_bytes = Some(1_000);
    assert!(edge.admit(at(0), &other).is_ok());
}

#[test]
fn r_ten_1_background_responses_in_flight_are_limited_per_key() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut r = request(1, "k", "p", T0);
    r.background = true;
    r.durable = true;
    r.key_limits.background_responses = Some(2);
    r.key_held.background = 2;
    let refusal = edge.admit(at(0), &r).unwrap_err();
    assert_eq!(refusal.kind, RefusalKind::RateLimited);
    assert_eq!(refusal.meter, Some(Meter::Background));
    assert!(refusal.retry_after_ms.is_some());
    r.key_held.background = 1;
    assert!(edge.admit(at(0), &r).is_ok());
}

#[test]
fn r_ten_5_a_settled_request_yields_its_usage_row_once() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut r = request(1, "k", "p", T0 + 5);
    r.price = Some(Price {
        input_per_mtok: 1_000_000,
        cached_input_per_mtok: 500_000,
        cache_write_per_mtok: 1_000_000,
        output_per_mtok: 2_000_000,
    });
    edge.admit(at(0), &r).unwrap();
    let used = TokenUse {
        input: 10,
        cached_input: 4,
        cache_write_input: 0,
        output: 3,
    };
    let (row, totals) = edge.settle(at(1), 1, used).unwrap();
    assert_eq!(row.day_unix_ms, usage::day_of(T0));
    assert_eq!(
        (row.principal.as_str(), row.key.as_str(), row.model.as_str()),
        ("p", "k", "m")
    );
    assert_eq!(totals.requests, 1);
    assert_eq!(totals.spend_micros, 6 + 2 + 6);
    assert_eq!(edge.settle(at(2), 1, used), None);
}

#[test]
fn r_ten_2_a_prompt_is_bounded_by_its_bodys_bytes() {
    // A body's bytes bound its prompt's tokens from above: never less
    // than the text it carries, so never less than its tokens.
    let text = "hello world, how are you today?";
    let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{text}"}}]}}"#);
    let bound = prompt_tokens_max(body.len() as u64);
    assert!(bound >= text.len() as u64);
    assert_eq!(prompt_tokens_max(0), 0);
}

#[test]
fn r_ten_2_cache_writes_are_priced_at_their_own_rate_and_reserved_at_the_dearest() {
    let price = Price {
        input_per_mtok: 1_000_000,
        cached_input_per_mtok: 100_000,
        cache_write_per_mtok: 1_250_000,
        output_per_mtok: 2_000_000,
    };
    // 100 input: 40 read from the cache, 40 written to it, 20 plain.
    let used = TokenUse {
        input: 100,
        cached_input: 40,
        cache_write_input: 40,
        output: 10,
    };
    assert_eq!(used.cost(&price), 20 + 4 + 50 + 20);
    // Counts past the input are clamped: no token is priced twice.
    let over = TokenUse {
        input: 10,
        cached_input: 8,
        cache_write_input: 8,
        output: 0,
    };
    assert_eq!(over.cost(&price), 1 + 3);

    // A reservation holds the prompt at the dearest input rate, so a
    // request whose prompt is all cache writes settles within it.
    let mut edge = Tenants::new(TenantsConfig {
        chunk_fraction: 1.0,
        ..TenantsConfig::default()
    });
    let mut store = Store::default();
    let (limits, _) = priced(1_000);
    let mut r = request(1, "k1", "p1", T0);
    r.principal_limits = limits;
    r.price = Some(price);
    edge.admit(at(0), &r).unwrap();
    store.serve(&mut edge, at(0));
    let all_written = TokenUse {
        input: r.prompt_tokens_max,
        cache_write_input: r.prompt_tokens_max,
        output: r.output_tokens_max,
        ..TokenUse::default()
    };
    let reserved = TokenUse {
        input: r.prompt_tokens_max,
        output: r.output_tokens_max,
        ..TokenUse::default()
    }
    .cost(&Price {
        input_per_mtok: 1_250_000,
        ..price
    });
    assert!(all_written.cost(&price) <= reserved);
    let (_, totals) = edge.settle(at(1), 1, all_written).unwrap();
    assert_eq!(totals.spend_micros, all_written.cost(&price));
}

/// R-TEN-1, R-TEN-3: with a small limit the chunk is one request, so a
/// second request while the first chunk's claim is on its way is refused
/// on this Edge's holding, not the window's: it waits for the claim and is
/// admitted once the store answers; its refusal, had it stood, shows no
/// room in its headers.
#[test]
fn r_ten_1_a_request_refused_only_while_a_claim_is_on_its_way_waits_for_it_and_is_admitted() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let ask = |ticket: u64| {
        let mut r = request(ticket, "k1", "p1", T0 + 1_000);
        r.key_limits = rpm(5);
        r
    };
    assert_eq!(edge.chunk(5), 1);
    assert_eq!(
        edge.admit_waiting(at(0), &ask(1), None),
        Admission::Admitted
    );
    let Admission::Wait { until } = edge.admit_waiting(at(1), &ask(2), None) else {
        panic!("a claim is on its way: the second request waits");
    };
    assert_eq!(until, at(1).saturating_add(CLAIM_WAIT));
    assert_eq!(edge.claim_waiters("k1"), 1);
    // Refused while the claim is on its way, its headers show no room.
    let refusal = edge.admit(at(1), &ask(2)).unwrap_err();
    assert!(refusal.claim_pending);
    assert_eq!(
        edge.refused_rate(&ask(2), Meter::Requests, &refusal)
            .unwrap()
            .remaining,
        0
    );
    assert_eq!(
        edge.tighter_rate(&ask(2), Meter::Requests)
            .unwrap()
            .remaining,
        4,
        "the window's room as this Edge counts it"
    );
    // Asked again before the store answered: still waiting, same end.
    assert_eq!(
        edge.admit_waiting(at(300), &ask(2), Some(at(1))),
        Admission::Wait { until }
    );
    store.serve(&mut edge, at(400));
    assert_eq!(
        edge.admit_waiting(at(400), &ask(2), Some(at(1))),
        Admission::Admitted
    );
    edge.end_claim_wait("k1");
    assert_eq!(edge.claim_waiters("k1"), 0);
}

/// R-TEN-1: a wait is bounded in time (after CLAIM_WAIT the refusal
/// stands) and in number per key (a key's MAX_CLAIM_WAITERS; another key
/// waits regardless); a refusal that is not the holding's never waits.
#[test]
fn r_ten_1_waiting_for_a_claim_is_bounded_in_time_and_per_key() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let ask = |ticket: u64, key: &str, limit: u64| {
        let mut r = request(ticket, key, "p1", T0 + 1_000);
        r.key_limits = rpm(limit);
        r
    };
    assert_eq!(
        edge.admit_waiting(at(0), &ask(1, "k1", 5), None),
        Admission::Admitted
    );
    for i in 0..MAX_CLAIM_WAITERS {
        assert!(matches!(
            edge.admit_waiting(at(0), &ask(10 + u64::from(i), "k1", 5), None),
            Admission::Wait { .. }
        ));
    }
    let Admission::Refused(refusal) = edge.admit_waiting(at(0), &ask(99, "k1", 5), None) else {
        panic!("the key's waiting places are taken");
    };
    assert!(refusal.claim_pending);
    assert_eq!(
        edge.admit_waiting(at(0), &ask(100, "k2", 5), None),
        Admission::Admitted
    );
    assert!(matches!(
        edge.admit_waiting(at(0), &ask(101, "k2", 5), None),
        Admission::Wait { .. }
    ));
    // The store never answers: after CLAIM_WAIT the refusal stands.
    let late = at(0).saturating_add(CLAIM_WAIT);
    let Admission::Refused(refusal) = edge.admit_waiting(late, &ask(10, "k1", 5), Some(at(0)))
    else {
        panic!("the wait is over");
    };
    assert_eq!(refusal.retry_after_ms, Some(CLAIM_RETRY_MS));
    for _ in 0..MAX_CLAIM_WAITERS {
        edge.end_claim_wait("k1");
    }
    assert_eq!(edge.claim_waiters("k1"), 0);
    // A window the store says is exhausted refuses at once, no wait.
    let mut store = Store::default();
    let mut edge = Tenants::new(TenantsConfig::default());
    store.claimed.insert(
        CounterKey {
            subject: Subject::Key("k3".into()),
            meter: Meter::Requests,
            window_unix_ms: T0,
        },
        5,
    );
    assert_eq!(
        edge.admit_waiting(at(0), &ask(1, "k3", 5), None),
        Admission::Admitted
    );
    store.serve(&mut edge, at(0));
    let Admission::Refused(refusal) = edge.admit_waiting(at(0), &ask(2, "k3", 5), None) else {
        panic!("exhausted: refused");
    };
    assert!(!refusal.claim_pending);
    assert_eq!(refusal.retry_after_ms, Some(59_000));
    assert_eq!(edge.claim_waiters("k3"), 0);
    assert_eq!(
        edge.refused_rate(&ask(2, "k3", 5), Meter::Requests, &refusal)
            .unwrap()
            .remaining,
        0
    );
}

fn concurrent(limit: u64) -> Limits {
    Limits {
        concurrent_requests: Some(limit),
        ..Limits::default()
    }
}

proptest! {
    /// R-TEN-1 across Edges: whatever the order of admissions, settlements
    /// and the store's answers over 1-4 Edges, a key's requests in flight
    /// over every Edge stay within its limit + Edges x chunk, and the
    /// store never leases more slots than the limit.
    #[test]
    fn r_ten_1_requests_in_flight_stay_within_the_limit_plus_edges_times_chunk(
        edges in 1usize..=4,
        limit in 1u64..12,
        ops in proptest::collection::vec((0usize..4, 0u8..4), 1..300),
    ) {
        let mut machines: Vec<Tenants> =
            (0..edges).map(|_| Tenants::new(TenantsConfig::default())).collect();
        let mut store = Store { unix_ms: T0, ..Store::default() };
        let mut open: Vec<Vec<u64>> = vec![Vec::new(); edges];
        let key = Subject::Key("k1".into());
        let mut ticket = 0;
        let mut now = 0;
        for (edge, op) in ops {
            let edge = edge % edges;
            now += 7;
            store.unix_ms = T0 + now;
            match op {
                0 | 1 => {
                    ticket += 1;
                    let mut r = request(ticket, "k1", "p1", T0 + now);
                    r.key_limits = concurrent(limit);
                    if machines[edge].admit(at(now), &r).is_ok() {
                        open[edge].push(ticket);
                    }
                }
                2 => {
                    if let Some(t) = open[edge].pop() {
                        machines[edge].release(at(now), t);
                    }
                }
                _ => {
                    store.serve_as(&format!("edge-{edge}"), &mut machines[edge], now);
                }
            }
            let in_flight: u64 = machines.iter().map(|m| m.in_flight(&key)).sum();
            let chunk = machines[0].chunk(limit);
            prop_assert!(
                in_flight <= limit + edges as u64 * chunk,
                "{in_flight} in flight, limit {limit}, {edges} Edges x {chunk}"
            );
            for book in store.slots.values() {
                prop_assert!(book.total(store.unix_ms) <= limit);
            }
        }
    }
}

/// R-TEN-1: an Edge that dies holding slots keeps them only until its
/// lease lapses; another Edge then gets the whole limit. An Edge with
/// nothing in flight gives its slots back at its next renewal.
#[test]
fn r_ten_1_a_dead_edges_slots_come_back_when_its_lease_lapses() {
    let cfg = TenantsConfig::default();
    let lease = cfg.slot_lease_ms;
    let mut store = Store {
        unix_ms: T0,
        ..Store::default()
    };
    let ask = |ticket: u64, unix_ms: u64| {
        let mut r = request(ticket, "k1", "p1", unix_ms);
        r.key_limits = concurrent(4);
        r
    };
    let key = Subject::Key("k1".into());
    let mut a = Tenants::new(cfg);
    for t in 1..=4 {
        assert_eq!(a.admit(at(0), &ask(t, T0)), Ok(()));
        store.serve_as("a", &mut a, 0);
    }
    assert_eq!(a.slots_held(&key), 4);
    assert!(
        a.admit(at(0), &ask(5, T0)).is_err(),
        "the limit, on one Edge"
    );
    drop(a); // the Edge dies with its four slots.
    let mut b = Tenants::new(cfg);
    // One on credit; the store has nothing to give.
    assert_eq!(b.admit(at(10), &ask(1, T0 + 10)), Ok(()));
    store.serve_as("b", &mut b, 10);
    assert_eq!(b.slots_held(&key), 0);
    let refusal = b.admit(at(20), &ask(2, T0 + 20)).unwrap_err();
    assert!(
        !refusal.claim_pending,
        "the store said full: refused at once"
    );
    assert_eq!(refusal.retry_after_ms, Some(SLOTS_FULL_MS));
    // The dead Edge's lease lapses: its slots are given out again.
    let later = lease + 10;
    store.unix_ms = T0 + later;
    let refusal = b.admit(at(later), &ask(3, T0 + later)).unwrap_err();
    assert!(refusal.claim_pending, "asked the store again");
    store.serve_as("b", &mut b, later);
    for t in 3..=5 {
        assert_eq!(b.admit(at(later), &ask(t, T0 + later)), Ok(()), "{t}");
        store.serve_as("b", &mut b, later);
    }
    assert_eq!(b.in_flight(&key), 4);
    assert_eq!(b.slots_held(&key), 4);
    // Everything ends; a renewal a third of a lease later gives all back.
    for t in [1, 3, 4, 5] {
        b.release(at(later), t);
    }
    store.serve_as("b", &mut b, later);
    let renew = later + lease / 3 + 1;
    store.unix_ms = T0 + renew;
    assert!(b.poll_timeout().is_some_and(|t| t <= at(renew)));
    b.handle_timeout(at(renew));
    store.serve_as("b", &mut b, renew);
    assert_eq!(b.slots_held(&key), 0);
    assert!(store.slots.values().all(|book| book.is_empty(T0 + renew)));
}

/// R-TEN-1, R-TEN-3: an Edge that stops after its requests drained gives
/// back every slot it holds at once: another Edge gets the whole limit
/// without waiting for the stopped Edge's lease. Stopping, it asks for
/// nothing more (no slot, no chunk of a window, no admission on credit),
/// and an ask on its way when it stops gives back once it is answered.
#[test]
fn r_ten_1_a_stopping_edge_hands_back_its_slots_at_once() {
    let cfg = TenantsConfig::default();
    let mut store = Store {
        unix_ms: T0,
        ..Store::default()
    };
    let ask = |ticket: u64, key: &str| {
        let mut r = request(ticket, key, "p1", T0);
        r.key_limits = Limits {
            requests_per_minute: Some(100),
            ..concurrent(4)
        };
        r
    };
    let key = Subject::Key("k1".into());
    let mut a = Tenants::new(cfg);
    for t in 1..=3 {
        assert_eq!(a.admit(at(0), &ask(t, "k1")), Ok(()));
        store.serve_as("a", &mut a, 0);
    }
    assert_eq!(a.slots_held(&key), 4, "three in flight and a chunk spare");
    let mut b = Tenants::new(cfg);
    assert_eq!(b.admit(at(0), &ask(1, "k1")), Ok(()), "one on credit");
    store.serve_as("b", &mut b, 0);
    assert_eq!(b.slots_held(&key), 0, "a holds the whole limit");
    assert!(!a.handed_back(), "not stopping");

    // The requests drained (one still running counts nothing past the
    // process's end); the Edge stops.
    a.release(at(5), 1);
    a.release(at(5), 2);
    store.serve_as("a", &mut a, 0);
    a.hand_back(T0);
    assert!(!a.handed_back(), "the store has not answered yet");
    assert_eq!(
        store.serve_as("a", &mut a, 0),
        2,
        "the slots' give-back, and the requests' window's unused rest"
    );
    assert!(a.handed_back());
    assert_eq!(a.slots_held(&key), 0);
    assert_eq!(
        store.slots.values().map(|b| b.total(T0)).sum::<u64>(),
        0,
        "in the store at once, not when a's lease lapses"
    );
    // The last request ends; stopping, a asks for nothing more, not even
    // the next chunk of a window, and admits nothing on credit.
    a.release(at(6), 3);
    assert_eq!(store.serve_as("a", &mut a, 0), 0);
    assert!(a.admit(at(6), &ask(9, "k1")).is_err());
    assert_eq!(store.serve_as("a", &mut a, 0), 0);
    a.handle_timeout(at(cfg.slot_lease_ms));
    assert_eq!(store.serve_as("a", &mut a, 0), 0, "no renewal either");

    // b gets the whole limit now, once the store's "full" of a moment ago
    // is over, well before a's lease would lapse.
    let now = SLOTS_FULL_MS + 1;
    assert!(now < cfg.slot_lease_ms / 2);
    store.unix_ms = T0 + now;
    for t in 2..=4 {
        if b.admit(at(now), &ask(t, "k1")).is_err() {
            store.serve_as("b", &mut b, 0);
            assert_eq!(b.admit(at(now), &ask(t, "k1")), Ok(()), "{t}");
        }
        store.serve_as("b", &mut b, 0);
    }
    assert_eq!(b.in_flight(&key), 4);
    assert_eq!(b.slots_held(&key), 4);

    // An ask on its way when the Edge stops: given back once answered.
    let mut c = Tenants::new(cfg);
    assert_eq!(c.admit(at(20), &ask(1, "k2")), Ok(()));
    c.hand_back(T0);
    assert_eq!(
        store.serve_as("c", &mut c, 0),
        4,
        "the window's claim and the ask made before, then their give-backs"
    );
    assert!(c.handed_back());
    assert_eq!(c.slots_held(&Subject::Key("k2".into())), 0);
}

/// R-TEN-2: an embedding asks for no output, so it reserves none and
/// nothing caps it; any other request asks for its client's maximum, or,
/// without one, the route's default.
#[test]
fn r_ten_2_an_embedding_asks_for_no_output_and_a_chat_for_its_maximum() {
    use iop_wire::RunApi;
    assert_eq!(output_tokens_asked(RunApi::Embeddings, None), Some(0));
    assert_eq!(output_tokens_asked(RunApi::Embeddings, Some(50)), Some(0));
    assert_eq!(output_tokens_asked(RunApi::Chat, Some(50)), Some(50));
    assert_eq!(output_tokens_asked(RunApi::Chat, None), None);
    // Asked for nothing, nothing is imposed on it.
    let mut r = request(1, "k", "p", 0);
    r.key_limits.tokens_per_minute = Some(10_000);
    r.output_tokens_max = 0;
    assert_eq!(
        r.output_cap(output_tokens_asked(RunApi::Embeddings, None)),
        None
    );
}

/// R-TEN-2: a request whose tokens or spend a limit counts, sent without
/// a maximum, is held to the output it reserved; with the client's
/// maximum, or nothing counting its output, nothing is imposed.
#[test]
fn r_ten_2_an_answer_without_a_maximum_is_held_to_the_output_it_reserved() {
    let mut r = request(1, "k", "p", 0);
    r.output_tokens_max = 4096;
    assert_eq!(r.output_cap(None), None, "no limit counts it");
    r.key_limits = rpm(10);
    assert_eq!(r.output_cap(None), None, "a request rate does not");
    let (budget, price) = priced(1_000);
    r.principal_limits = budget;
    assert_eq!(r.output_cap(None), None, "a budget of an unpriced model");
    r.price = Some(price);
    assert_eq!(r.output_cap(None), Some(4096), "a budget of a priced one");
    assert_eq!(r.output_cap(Some(100)), None, "the client's maximum stands");
    let mut r = request(2, "k", "p", 0);
    r.output_tokens_max = 512;
    r.key_limits.tokens_per_minute = Some(10_000);
    assert_eq!(r.output_cap(None), Some(512), "tokens per minute");
    let mut r = request(3, "k", "p", 0);
    r.output_tokens_max = 512;
    r.principal_limits.per_model.insert(
        "m".into(),
        ModelLimits {
            tokens_per_minute: Some(10_000),
            ..ModelLimits::default()
        },
    );
    assert_eq!(
        r.output_cap(None),
        Some(512),
        "the model's tokens per minute"
    );
    r.model = "other".into();
    assert_eq!(r.output_cap(None), None, "another model's limit");
}
