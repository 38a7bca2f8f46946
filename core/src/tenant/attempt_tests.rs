//! A fresh reservation per further attempt (R-TEN-2): a failover or a
//! continuation sends the prompt again, so it reserves again before it is
//! admitted, and the settlement gives every reservation back once and
//! charges what the request used once.

use super::tests::{T0, at};
use super::*;

/// One Edge whose claims the store grants at once (`check_claim` on one
/// counter table).
struct Edge {
    machine: Tenants,
    claimed: BTreeMap<CounterKey, u64>,
}

impl Edge {
    fn new() -> Self {
        Edge {
            machine: Tenants::new(TenantsConfig {
                chunk_fraction: 1.0,
                ..TenantsConfig::default()
            }),
            claimed: BTreeMap::new(),
        }
    }

    fn serve(&mut self, now: Instant) {
        while let Some(TenantsOutput::Claim {
            counter,
            amount,
            limit,
        }) = self.machine.poll_output()
        {
            let claimed = self.claimed.entry(counter.clone()).or_default();
            let (total, granted) = check_claim(*claimed, amount, limit);
            *claimed = total;
            self.machine.handle_input(
                now,
                TenantsInput::Claimed {
                    counter,
                    granted: Some(granted),
                },
            );
        }
    }
}

/// A request of principal `p` reserving 10 prompt + 20 output tokens at 1
/// micro-unit a token (30), under a budget in total of `budget` and,
/// optionally, tokens per minute.
fn request(ticket: u64, budget: u64, tokens_per_minute: Option<u64>) -> AdmitRequest {
    AdmitRequest {
        ticket,
        key: "k".into(),
        principal: "p".into(),
        key_limits: Limits::default(),
        principal_limits: Limits {
            budget: Some(Budget {
                limit_micros: budget,
                period: Period::Total,
            }),
            tokens_per_minute,
            ..Limits::default()
        },
        price: Some(Price {
            input_per_mtok: 1_000_000,
            output_per_mtok: 1_000_000,
            ..Price::default()
        }),
        prompt_tokens_max: 10,
        output_tokens_max: 20,
        unix_ms: T0,
        model: "m".into(),
        durable: false,
        background: false,
        key_held: Held::default(),
        principal_held: Held::default(),
    }
}

fn spend() -> CounterKey {
    CounterKey {
        subject: Subject::Principal("p".into()),
        meter: Meter::Spend,
        window_unix_ms: 0,
    }
}

#[test]
fn r_ten_2_a_further_attempt_reserves_again_and_is_refused_when_it_does_not_fit() {
    let mut edge = Edge::new();
    assert!(edge.machine.admit(at(0), &request(1, 100, None)).is_ok());
    edge.serve(at(0));
    assert_eq!(edge.machine.reservations_of(1), 1);
    // Two more attempts fit (90 of 100); a third does not.
    for attempt in 2..=3 {
        assert_eq!(edge.machine.reserve_attempt(at(1), 1, 0, T0 + 1), Ok(()));
        edge.serve(at(1));
        assert_eq!(edge.machine.reservations_of(1), attempt);
    }
    assert_eq!(edge.machine.used(&spend()), Some(90));
    let AttemptRefusal {
        refusal,
        claim_pending,
    } = edge
        .machine
        .reserve_attempt(at(2), 1, 0, T0 + 2)
        .unwrap_err();
    assert!(!claim_pending, "the store has nothing left to grant");
    assert_eq!(refusal.kind, RefusalKind::InsufficientQuota);
    assert_eq!(refusal.subject, Subject::Principal("p".into()));
    assert_eq!(refusal.meter, Some(Meter::Spend));
    assert_eq!(
        edge.machine.reservations_of(1),
        3,
        "a refused attempt takes nothing"
    );
    assert_eq!(edge.machine.used(&spend()), Some(90));
}

#[test]
fn r_ten_2_an_attempt_right_after_its_admission_waits_for_the_claim_on_its_way() {
    // A chunk of a tenth: the admission's 30 is claimed, nothing more held.
    let mut edge = Edge::new();
    edge.machine = Tenants::new(TenantsConfig {
        chunk_fraction: 0.1,
        ..TenantsConfig::default()
    });
    let r = request(1, 300, None);
    assert!(edge.machine.admit(at(0), &r).is_ok(), "on credit");
    // The claim the admission set off is still on its way.
    let refused = edge
        .machine
        .reserve_attempt(at(1), 1, 0, T0 + 1)
        .unwrap_err();
    assert!(refused.claim_pending, "{refused:?}");
    edge.serve(at(2));
    assert_eq!(edge.machine.reserve_attempt(at(3), 1, 0, T0 + 3), Ok(()));
}

#[test]
fn r_ten_2_a_continuation_also_reserves_the_answer_so_far_as_input() {
    let mut edge = Edge::new();
    assert!(edge.machine.admit(at(0), &request(1, 1_000, None)).is_ok());
    edge.serve(at(0));
    assert_eq!(edge.machine.reserve_attempt(at(1), 1, 7, T0 + 1), Ok(()));
    let spends: Vec<u64> = edge
        .machine
        .held_by(1)
        .iter()
        .filter(|(c, _)| c.meter == Meter::Spend)
        .map(|(_, amount)| *amount)
        .collect();
    assert_eq!(
        spends,
        vec![30, 37],
        "the admission's, then 30 + 7 more input"
    );
}

#[test]
fn r_ten_2_settling_gives_every_reservation_back_once_and_charges_the_use_once() {
    let mut edge = Edge::new();
    assert!(edge.machine.admit(at(0), &request(1, 1_000, None)).is_ok());
    edge.serve(at(0));
    assert_eq!(edge.machine.reserve_attempt(at(1), 1, 5, T0 + 1), Ok(()));
    edge.serve(at(1));
    assert_eq!(edge.machine.used(&spend()), Some(65));
    // Both attempts used 35 together (25 in, 10 out).
    let used = TokenUse {
        input: 25,
        output: 10,
        ..TokenUse::default()
    };
    let (_, totals) = edge.machine.settle(at(2), 1, used).expect("settled once");
    assert_eq!(totals.spend_micros, 35);
    assert_eq!(edge.machine.used(&spend()), Some(35));
    assert_eq!(edge.machine.reservations_of(1), 0);
    assert!(edge.machine.settle(at(3), 1, used).is_none());
    assert!(edge.machine.release(at(3), 1).is_none());
    assert_eq!(edge.machine.used(&spend()), Some(35), "nothing twice");
}

#[test]
fn r_ten_2_an_attempt_in_a_later_minute_counts_its_tokens_there() {
    let mut edge = Edge::new();
    assert!(
        edge.machine
            .admit(at(0), &request(1, 1_000, Some(1_000)))
            .is_ok()
    );
    edge.serve(at(0));
    let later = T0 + MINUTE_MS + 5;
    assert_eq!(
        edge.machine.reserve_attempt(at(MINUTE_MS + 5), 1, 0, later),
        Ok(())
    );
    let minute = |window_unix_ms| CounterKey {
        subject: Subject::Principal("p".into()),
        meter: Meter::Tokens,
        window_unix_ms,
    };
    assert_eq!(edge.machine.used(&minute(T0)), Some(30));
    assert_eq!(edge.machine.used(&minute(T0 + MINUTE_MS)), Some(30));
    // 40 tokens: the first reservation's 30, the rest in the last minute.
    let used = TokenUse {
        input: 30,
        output: 10,
        ..TokenUse::default()
    };
    assert!(edge.machine.settle(at(MINUTE_MS + 6), 1, used).is_some());
    assert_eq!(edge.machine.used(&minute(T0)), Some(30));
    assert_eq!(edge.machine.used(&minute(T0 + MINUTE_MS)), Some(10));
}

#[test]
fn r_ten_2_a_ticket_this_edge_does_not_hold_has_nothing_to_reserve_against() {
    let mut edge = Edge::new();
    assert_eq!(edge.machine.reserve_attempt(at(0), 9, 0, T0), Ok(()));
    assert_eq!(edge.machine.reservations_of(9), 0);
    assert!(edge.machine.held_by(9).is_empty());
}

#[test]
fn r_ten_2_a_taken_over_request_reserves_each_attempt_and_settles_on_its_key() {
    let mut edge = Edge::new();
    let mut r = request(1, 100, Some(1_000));
    r.key_limits = Limits {
        concurrent_requests: Some(1),
        requests_per_minute: Some(1),
        ..Limits::default()
    };
    // Not a new request: held at once, reserving nothing yet, and not
    // counted against the key's request rate (R-TAKE-1).
    edge.machine.admit_taken_over(at(0), &r);
    assert_eq!(edge.machine.reservations_of(1), 0);
    assert!(edge.machine.held_by(1).is_empty());
    // Its continuation reserves its terms and the answer so far first.
    assert_eq!(edge.machine.reserve_attempt(at(1), 1, 5, T0 + 1), Ok(()));
    edge.serve(at(1));
    assert_eq!(edge.machine.used(&spend()), Some(35));
    // It counts as in flight on its key: another request of the key waits.
    let mut other = request(2, 100, None);
    other.key_limits = r.key_limits.clone();
    assert!(edge.machine.admit(at(2), &other).is_err());
    // Settled with its usage: charged once, on its key's usage row.
    let used = TokenUse {
        input: 20,
        output: 4,
        ..TokenUse::default()
    };
    let (row, totals) = edge.machine.settle(at(3), 1, used).expect("settled");
    assert_eq!((row.key.as_str(), row.principal.as_str()), ("k", "p"));
    assert_eq!(totals.spend_micros, 24);
    assert_eq!(edge.machine.used(&spend()), Some(24));
    assert_eq!(edge.machine.reservations_of(1), 0);
    assert!(
        edge.machine.admit(at(4), &other).is_ok(),
        "no longer in flight"
    );
}

#[test]
fn r_ten_2_a_taken_over_request_whose_attempt_does_not_fit_is_refused() {
    let mut edge = Edge::new();
    // 30 of its terms and 5 of answer so far do not fit 20.
    edge.machine.admit_taken_over(at(0), &request(1, 20, None));
    let refused = edge
        .machine
        .reserve_attempt(at(1), 1, 5, T0 + 1)
        .unwrap_err();
    assert_eq!(refused.refusal.kind, RefusalKind::InsufficientQuota);
    assert!(edge.machine.held_by(1).is_empty(), "nothing taken");
    assert!(edge.machine.release(at(2), 1).is_some());
    assert_eq!(edge.machine.reservations_of(1), 0);
}

#[test]
fn r_ten_2_an_adoption_is_reserved_on_credit_and_settles_the_runs_usage() {
    let mut edge = Edge::new();
    // A budget of 20 does not fit the terms (30): an adoption is never
    // refused, its reservation is taken on credit.
    let r = request(1, 20, Some(1_000));
    edge.machine.admit_adopted(at(0), &r);
    assert_eq!(edge.machine.reservations_of(1), 1, "the adoption's");
    assert_eq!(edge.machine.used(&spend()), Some(30));
    edge.serve(at(0));
    // A new request of the principal does not fit meanwhile.
    assert!(edge.machine.admit(at(1), &request(2, 20, None)).is_err());
    // The run's usage at its end covers the tokens before the cut too.
    let used = TokenUse {
        input: 10,
        output: 8,
        ..TokenUse::default()
    };
    let (row, totals) = edge.machine.settle(at(2), 1, used).expect("settled");
    assert_eq!((row.key.as_str(), row.model.as_str()), ("k", "m"));
    assert_eq!((totals.input_tokens, totals.output_tokens), (10, 8));
    assert_eq!(totals.spend_micros, 18);
    assert_eq!(edge.machine.used(&spend()), Some(18), "charged once");
    assert_eq!(edge.machine.reservations_of(1), 0);
}

#[test]
fn r_ten_2_a_lost_adoption_continued_reserves_its_continuation_too() {
    let mut edge = Edge::new();
    edge.machine.admit_adopted(at(0), &request(1, 100, None));
    edge.serve(at(0));
    // The adopted run is lost; its continuation sends the answer so far.
    assert_eq!(edge.machine.reserve_attempt(at(1), 1, 5, T0 + 1), Ok(()));
    assert_eq!(edge.machine.reservations_of(1), 2);
    assert_eq!(edge.machine.used(&spend()), Some(30 + 35));
    let used = TokenUse {
        input: 15,
        output: 9,
        ..TokenUse::default()
    };
    assert!(edge.machine.settle(at(2), 1, used).is_some());
    assert_eq!(edge.machine.used(&spend()), Some(24));
}

#[test]
fn r_ten_2_a_settlement_charges_the_reported_usage_plus_the_unmetered_input_and_output() {
    let reported = TokenUse {
        input: 10,
        cached_input: 4,
        cache_write_input: 0,
        output: 7,
    };
    let unmetered = |input, output| Unmetered { input, output };
    // Nothing unmetered: the report as it is (or a release without one).
    assert_eq!(
        TokenUse::settled(Some(reported), Unmetered::default()),
        Some(reported)
    );
    assert_eq!(TokenUse::settled(None, Unmetered::default()), None);
    // A cut attempt's estimated output adds to the output, its prompt to
    // the input (never to the cached counts).
    assert_eq!(
        TokenUse::settled(Some(reported), unmetered(0, 5)),
        Some(TokenUse {
            output: 12,
            ..reported
        })
    );
    assert_eq!(
        TokenUse::settled(Some(reported), unmetered(20, 5)),
        Some(TokenUse {
            input: 30,
            output: 12,
            ..reported
        })
    );
    // No report at all: the estimate is the whole charge; a prompt a
    // provider read with no text back is charged too.
    assert_eq!(
        TokenUse::settled(None, unmetered(0, 5)),
        Some(TokenUse {
            output: 5,
            ..TokenUse::default()
        })
    );
    assert_eq!(
        TokenUse::settled(None, unmetered(20, 0)),
        Some(TokenUse {
            input: 20,
            ..TokenUse::default()
        })
    );
    // Never wraps.
    assert_eq!(
        TokenUse::settled(
            Some(TokenUse {
                input: u64::MAX,
                output: u64::MAX,
                ..TokenUse::default()
            }),
            unmetered(1, 1)
        )
        .map(|u| (u.input, u.output)),
        Some((u64::MAX, u64::MAX))
    );
}

#[test]
fn r_ten_2_an_answer_a_takeover_ended_is_charged_on_its_key_at_once_on_credit() {
    let mut edge = Edge::new();
    // A budget of 20 does not fit 25: the answer was admitted by the Edge
    // that died, so its charge is never refused, and counts at once.
    let r = request(7, 20, Some(1_000));
    let used = TokenUse {
        input: 10,
        output: 15,
        ..TokenUse::default()
    };
    let (row, totals) = edge.machine.charge_ended(at(0), &r, used);
    assert_eq!((row.key.as_str(), row.principal.as_str()), ("k", "p"));
    assert_eq!(
        (totals.requests, totals.input_tokens, totals.output_tokens),
        (1, 10, 15),
        "the request counted once: its Edge never settled it"
    );
    assert_eq!(totals.spend_micros, 25);
    assert_eq!(edge.machine.used(&spend()), Some(25));
    assert_eq!(edge.machine.reservations_of(7), 0, "nothing held after");
    edge.serve(at(0));
    // The principal's next request finds the budget used.
    assert!(edge.machine.admit(at(1), &request(8, 20, None)).is_err());
}
