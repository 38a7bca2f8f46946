//! A stopping Edge gives back the unused rest of its windows' chunks,
//! exactly once (R-TEN-2, R-TEN-3): [`Tenants::hand_back`] and the
//! store's rule, [`check_give_back`], on the manual clock.

use super::test_world::{Store, T0, at, request};
use super::*;

/// A budget of 1,000 micro-units in total, one micro-unit per token: a
/// request of the test world reserves 30 (10 prompt + 20 output tokens),
/// and an Edge claims 100 at a time.
fn budget_request(ticket: u64) -> AdmitRequest {
    let mut r = request(ticket, "k1", "p1", "m", T0);
    r.principal_limits = Limits {
        budget: Some(Budget {
            limit_micros: 1_000,
            period: Period::Total,
        }),
        ..Limits::default()
    };
    r.price = Some(Price {
        input_per_mtok: 1_000_000,
        cached_input_per_mtok: 1_000_000,
        cache_write_per_mtok: 1_000_000,
        output_per_mtok: 1_000_000,
    });
    r
}

fn spend() -> CounterKey {
    CounterKey {
        subject: Subject::Principal("p1".into()),
        meter: Meter::Spend,
        window_unix_ms: 0,
    }
}

fn used(tokens: u64) -> TokenUse {
    TokenUse {
        input: tokens,
        ..TokenUse::default()
    }
}

fn outputs(edge: &mut Tenants) -> Vec<TenantsOutput> {
    std::iter::from_fn(|| edge.poll_output()).collect()
}

/// An Edge that admitted one request (reserving 30 on credit) and had
/// its claim (30 owed + a chunk of 100) granted.
fn edge_with_a_claim(store: &mut Store) -> Tenants {
    let mut a = Tenants::new(TenantsConfig::default());
    assert_eq!(a.admit(at(0), &budget_request(1)), Ok(()));
    store.serve_as("a", &mut a, 0);
    assert_eq!(store.claimed[&spend()], 130);
    a
}

#[test]
fn r_ten_2_a_stopping_edge_gives_back_its_unused_claim_and_another_edge_spends_it() {
    let mut store = Store::default();
    let mut a = edge_with_a_claim(&mut store);
    a.settle(at(1), 1, used(12));
    assert_eq!(a.used(&spend()), Some(12));
    assert_eq!(store.serve_as("a", &mut a, 1), 0, "nothing to claim");

    a.hand_back(T0);
    assert_eq!(
        outputs(&mut a),
        vec![TenantsOutput::GiveBack {
            counter: spend(),
            amount: 118,
        }],
        "what it was granted beyond what it used"
    );
    assert!(!a.handed_back(), "the store has not answered");
    // Sent again by hand: the store frees once.
    let give = |store: &mut Store| {
        store.answer_as(
            "a",
            TenantsOutput::GiveBack {
                counter: spend(),
                amount: 118,
            },
        )
    };
    let first = give(&mut store);
    assert_eq!(
        first,
        TenantsInput::GaveBack {
            counter: spend(),
            outcome: Some(GiveBackOutcome::Freed(118)),
        }
    );
    assert_eq!(
        store.claimed[&spend()],
        12,
        "only what a spent stays claimed"
    );
    assert_eq!(
        give(&mut store),
        TenantsInput::GaveBack {
            counter: spend(),
            outcome: Some(GiveBackOutcome::AlreadyGivenBack),
        }
    );
    assert_eq!(store.claimed[&spend()], 12, "a retry frees nothing more");
    a.handle_input(at(2), first);
    assert!(a.handed_back());
    assert_eq!(a.given_back().get(&Meter::Spend), Some(&118));

    // Another Edge may now claim all the rest of the budget.
    let mut b = Tenants::new(TenantsConfig::default());
    let mut ticket = 0;
    loop {
        ticket += 1;
        if b.admit(at(3), &budget_request(ticket)).is_err() {
            store.serve_as("b", &mut b, 3);
            if b.admit(at(3), &budget_request(ticket)).is_err() {
                break;
            }
        }
        store.serve_as("b", &mut b, 3);
    }
    assert_eq!(store.claimed[&spend()], 1_000);
    assert!(
        b.used(&spend()).unwrap_or(0) >= 1_000 - 12 - 30,
        "b spent what a gave back: {:?}",
        b.used(&spend())
    );
}

#[test]
fn r_ten_2_what_a_request_in_flight_reserved_is_never_given_back() {
    let mut store = Store::default();
    let mut a = edge_with_a_claim(&mut store);
    assert_eq!(a.admit(at(1), &budget_request(2)), Ok(()));
    store.serve_as("a", &mut a, 1);
    a.settle(at(2), 1, used(12));
    store.serve_as("a", &mut a, 2);
    // 12 settled, 30 held by request 2, still in flight.
    assert_eq!(a.used(&spend()), Some(42));
    let granted = store.claimed[&spend()];
    a.hand_back(T0);
    assert_eq!(
        outputs(&mut a),
        vec![TenantsOutput::GiveBack {
            counter: spend(),
            amount: granted - 42,
        }]
    );
    // It ends after the stop, using less: nothing more goes back (one
    // give-back per counter) and nothing more is claimed.
    a.settle(at(3), 2, used(5));
    assert!(outputs(&mut a).is_empty());
}

#[test]
fn r_ten_3_a_give_back_whose_answer_was_lost_is_sent_again_and_frees_once() {
    let mut store = Store::default();
    let mut a = edge_with_a_claim(&mut store);
    a.settle(at(1), 1, used(30));
    store.lose_give_back_answers = 1;
    a.hand_back(T0);
    assert_eq!(store.serve_as("a", &mut a, 1), 1);
    assert_eq!(
        store.claimed[&spend()],
        30,
        "applied; the Edge heard a failure"
    );
    assert!(!a.handed_back(), "it sends it again");
    assert_eq!(a.poll_timeout(), Some(at(1 + GIVE_BACK_RETRY_MS)));
    a.handle_timeout(at(1 + GIVE_BACK_RETRY_MS - 1));
    assert!(outputs(&mut a).is_empty(), "not before its time");
    a.handle_timeout(at(1 + GIVE_BACK_RETRY_MS));
    let again = outputs(&mut a);
    assert_eq!(
        again,
        vec![TenantsOutput::GiveBack {
            counter: spend(),
            amount: 100,
        }],
        "the same amount"
    );
    for out in again {
        let input = store.answer_as("a", out);
        a.handle_input(at(1 + GIVE_BACK_RETRY_MS), input);
    }
    assert_eq!(store.claimed[&spend()], 30, "freed once");
    assert!(a.handed_back());
    assert_eq!(a.given_back().get(&Meter::Spend), Some(&100));
}

#[test]
fn r_ten_3_a_give_back_the_store_never_takes_is_given_up_and_stays_claimed() {
    let mut store = Store::default();
    let mut a = edge_with_a_claim(&mut store);
    a.settle(at(1), 1, used(30));
    store.down = true;
    a.hand_back(T0);
    let mut now = 1;
    let mut sent = 0;
    while !a.handed_back() {
        sent += store.serve_as("a", &mut a, now);
        if a.handed_back() {
            break;
        }
        let Some(next) = a.poll_timeout() else {
            break;
        };
        now = next.as_millis();
        a.handle_timeout(next);
    }
    assert!(a.handed_back());
    assert_eq!(sent, MAX_GIVE_BACK_ASKS as usize);
    assert_eq!(store.claimed[&spend()], 130, "it stays claimed");
    assert_eq!(a.given_back().get(&Meter::Spend), None);
    assert!(
        now <= 1 + u64::from(MAX_GIVE_BACK_ASKS) * GIVE_BACK_RETRY_MS,
        "within the shell's wait of 2 s: {now} ms"
    );
}

#[test]
fn r_ten_3_a_claim_on_its_way_at_the_stop_is_given_back_once_answered() {
    let mut store = Store::default();
    let mut a = Tenants::new(TenantsConfig::default());
    assert_eq!(a.admit(at(0), &budget_request(1)), Ok(()));
    let claim = outputs(&mut a);
    assert!(matches!(claim[..], [TenantsOutput::Claim { .. }]));
    a.settle(at(1), 1, used(10));
    a.hand_back(T0);
    assert!(outputs(&mut a).is_empty(), "not before the claim's answer");
    assert!(!a.handed_back(), "a claim is on its way");
    for out in claim {
        let input = store.answer_as("a", out);
        a.handle_input(at(2), input);
    }
    assert_eq!(
        outputs(&mut a),
        vec![TenantsOutput::GiveBack {
            counter: spend(),
            amount: 120,
        }],
        "what the claim brought, beyond what was used"
    );
    // A claim whose answer fails at the stop: what it may have claimed
    // stays claimed, and nothing more is asked.
    let mut c = Tenants::new(TenantsConfig::default());
    assert_eq!(c.admit(at(0), &budget_request(1)), Ok(()));
    let claim = outputs(&mut c);
    c.hand_back(T0);
    for out in claim {
        c.handle_input(
            at(2),
            TenantsInput::Claimed {
                counter: out.counter().clone(),
                granted: None,
            },
        );
    }
    assert!(outputs(&mut c).is_empty());
    assert!(c.handed_back());
}

#[test]
fn r_ten_3_a_minute_already_over_gives_nothing_back_and_a_stopped_edge_claims_nothing() {
    let mut store = Store::default();
    let mut a = Tenants::new(TenantsConfig::default());
    let mut r = request(1, "k1", "p1", "m", T0);
    r.key_limits = Limits {
        requests_per_minute: Some(100),
        tokens_per_minute: Some(10_000),
        ..Limits::default()
    };
    assert_eq!(a.admit(at(0), &r), Ok(()));
    store.serve_as("a", &mut a, 0);
    a.settle(at(1), 1, used(12));
    store.serve_as("a", &mut a, 1);
    a.hand_back(T0 + MINUTE_MS);
    assert!(outputs(&mut a).is_empty(), "its minute is over");
    assert!(a.handed_back());

    // In its minute, both windows go back; then nothing is claimed.
    let mut b = Tenants::new(TenantsConfig::default());
    r.ticket = 2;
    assert_eq!(b.admit(at(0), &r), Ok(()));
    store.serve_as("b", &mut b, 0);
    b.hand_back(T0 + 10);
    let back = outputs(&mut b);
    assert_eq!(back.len(), 2, "{back:?}");
    assert!(
        back.iter()
            .all(|o| matches!(o, TenantsOutput::GiveBack { amount, .. } if *amount > 0))
    );
    for out in back {
        let input = store.answer_as("b", out);
        b.handle_input(at(1), input);
    }
    assert!(b.handed_back());
    r.ticket = 3;
    let _ = b.admit(at(2), &r);
    let _ = b.reserve_attempt(at(2), 2, 1_000, T0 + 20);
    assert!(
        outputs(&mut b)
            .iter()
            .all(|o| !matches!(o, TenantsOutput::Claim { .. })),
        "stopping, it claims nothing"
    );
}
