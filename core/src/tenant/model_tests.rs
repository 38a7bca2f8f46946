//! Limits per model (R-TEN-1), step by step with a manual clock, and as
//! properties over many Edges sharing one counter store.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::test_world::{Step, Store, T0, World, at, step};
use super::*;

fn request(ticket: u64, model: &str, unix_ms: u64) -> AdmitRequest {
    super::test_world::request(ticket, "k1", "p1", model, unix_ms)
}

fn per_model(model: &str, limits: ModelLimits) -> Limits {
    Limits {
        per_model: [(model.to_owned(), limits)].into(),
        ..Limits::default()
    }
}

fn model_rpm(n: u64) -> ModelLimits {
    ModelLimits {
        requests_per_minute: Some(n),
        ..ModelLimits::default()
    }
}

fn key_model(model: &str) -> Subject {
    Subject::KeyModel {
        key: "k1".into(),
        model: model.into(),
    }
}

#[test]
fn r_ten_1_a_key_at_a_models_requests_per_minute_is_refused_for_it_and_served_for_another() {
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let limits = per_model("a", model_rpm(5));
    let mut ticket = 0;
    let mut admit = |edge: &mut Tenants, model: &str, unix_ms: u64, now: u64| {
        ticket += 1;
        let mut r = request(ticket, model, unix_ms);
        r.key_limits = limits.clone();
        let answer = edge.admit(at(now), &r);
        store.serve(edge, at(now));
        answer
    };
    for _ in 0..5 {
        assert_eq!(admit(&mut edge, "a", T0 + 1_000, 0), Ok(()));
    }
    let refusal = admit(&mut edge, "a", T0 + 1_000, 0).unwrap_err();
    assert_eq!(
        refusal,
        Refusal {
            kind: RefusalKind::RateLimited,
            subject: key_model("a"),
            meter: Some(Meter::Requests),
            retry_after_ms: Some(59_000),
            claim_pending: false,
        }
    );
    for _ in 0..50 {
        assert_eq!(admit(&mut edge, "b", T0 + 1_000, 0), Ok(()), "model b");
    }
    assert_eq!(
        admit(&mut edge, "a", T0 + MINUTE_MS, 60_000),
        Ok(()),
        "a new window"
    );
}

#[test]
fn r_ten_1_every_applicable_limit_must_admit_and_the_tightest_refuses() {
    // Key: 4 per minute in all, 10 for model a. Principal: 3 for model a.
    let key = Limits {
        requests_per_minute: Some(4),
        ..per_model("a", model_rpm(10))
    };
    let principal = per_model("a", model_rpm(3));
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let mut refusals = Vec::new();
    for (i, model) in ["a", "a", "a", "a", "b", "b"].into_iter().enumerate() {
        let mut r = request(i as u64, model, T0);
        r.key_limits = key.clone();
        r.principal_limits = principal.clone();
        if let Err(refusal) = edge.admit(at(0), &r) {
            refusals.push((i, refusal.subject));
        }
        store.serve(&mut edge, at(0));
    }
    assert_eq!(
        refusals,
        vec![
            (
                3,
                Subject::PrincipalModel {
                    principal: "p1".into(),
                    model: "a".into()
                }
            ),
            (5, Subject::Key("k1".into())),
        ],
        "a's 4th: the principal's 3 for a; b's 2nd: the key's 4 in all (3 a + 1 b)"
    );
}

#[test]
fn r_ten_1_the_rate_headers_report_the_tightest_applicable_limit() {
    let key = Limits {
        requests_per_minute: Some(100),
        ..per_model("a", model_rpm(3))
    };
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    for i in 0..2 {
        let mut r = request(i, "a", T0 + 30_000);
        r.key_limits = key.clone();
        edge.admit(at(0), &r).unwrap();
        store.serve(&mut edge, at(0));
    }
    let mut a = request(9, "a", T0 + 30_000);
    a.key_limits = key.clone();
    let state = edge.tighter_rate(&a, Meter::Requests).unwrap();
    assert_eq!(
        (state.limit, state.remaining, state.reset_ms),
        (3, 1, 30_000)
    );
    let mut b = request(9, "b", T0 + 30_000);
    b.key_limits = key;
    let state = edge.tighter_rate(&b, Meter::Requests).unwrap();
    assert_eq!(
        (state.limit, state.remaining),
        (100, 98),
        "model b: only the key's whole limit applies"
    );
    assert_eq!(edge.tighter_rate(&b, Meter::Tokens), None);
}

#[test]
fn r_ten_1_a_models_tokens_are_counted_from_the_providers_usage() {
    let limits = per_model(
        "a",
        ModelLimits {
            tokens_per_minute: Some(1_000),
            ..ModelLimits::default()
        },
    );
    let mut edge = Tenants::new(TenantsConfig::default());
    let mut store = Store::default();
    let mut r = request(1, "a", T0);
    r.key_limits = limits.clone();
    edge.admit(at(0), &r).unwrap();
    store.serve(&mut edge, at(0));
    let counter = CounterKey {
        subject: key_model("a"),
        meter: Meter::Tokens,
        window_unix_ms: T0,
    };
    assert_eq!(edge.used(&counter), Some(30), "reserved: prompt + output");
    // A further attempt reserves again on the model's counter (R-TEN-2).
    edge.reserve_attempt(at(1), 1, 5, T0).unwrap();
    assert_eq!(edge.used(&counter), Some(65));
    let used = TokenUse {
        input: 12,
        cached_input: 4,
        cache_write_input: 0,
        output: 9,
    };
    edge.settle(at(2), 1, used).unwrap();
    assert_eq!(
        edge.used(&counter),
        Some(21),
        "settled at the usage summed over the attempts"
    );
    // A request that fits the model's tokens no more is refused, with
    // the window's end to wait for.
    let mut big = request(2, "a", T0);
    big.key_limits = limits;
    big.prompt_tokens_max = 980;
    let refusal = edge.admit(at(3), &big).unwrap_err();
    assert_eq!(
        (refusal.subject, refusal.meter),
        (key_model("a"), Some(Meter::Tokens))
    );
}

#[test]
fn r_ten_1_a_models_requests_in_flight_are_limited_and_freed_when_settled() {
    let limits = per_model(
        "a",
        ModelLimits {
            concurrent_requests: Some(1),
            ..ModelLimits::default()
        },
    );
    let mut edge = Tenants::new(TenantsConfig::default());
    let ask = |ticket, model| {
        let mut r = request(ticket, model, T0);
        r.key_limits = limits.clone();
        r
    };
    assert_eq!(edge.admit(at(0), &ask(1, "a")), Ok(()));
    let refusal = edge.admit(at(0), &ask(2, "a")).unwrap_err();
    assert_eq!((refusal.subject, refusal.meter), (key_model("a"), None));
    assert_eq!(edge.admit(at(0), &ask(3, "b")), Ok(()));
    assert_eq!(edge.admit(at(0), &ask(4, "b")), Ok(()));
    edge.release(at(1), 1);
    assert_eq!(edge.admit(at(1), &ask(5, "a")), Ok(()));
}

const MODELS: [&str; 2] = ["a", "b"];
const MODEL_RPM: u64 = 30;
const MODEL_TPM: u64 = 900;

/// One key with rates for each model and none in all; its principal with
/// rates for model b.
fn limits() -> (Limits, Limits) {
    let rates = ModelLimits {
        requests_per_minute: Some(MODEL_RPM),
        tokens_per_minute: Some(MODEL_TPM),
        concurrent_requests: Some(6),
    };
    let key = Limits {
        per_model: MODELS.iter().map(|m| ((*m).to_owned(), rates)).collect(),
        ..Limits::default()
    };
    (key, per_model("b", model_rpm(MODEL_RPM / 2)))
}

/// What a world did: each model's admission decisions and the requests
/// admitted per (model, minute).
type Outcome = (Vec<Vec<Result<(), Refusal>>>, BTreeMap<(usize, u64), u64>);

/// Run `steps` on `edges` Edges (`only`: that model's steps alone; `who`
/// of a step is the model).
fn world(edges: usize, steps: &[Step], only: Option<usize>) -> Outcome {
    let (key_limits, principal_limits) = limits();
    let mut world = World::new(edges);
    let mut decisions = vec![Vec::new(), Vec::new()];
    let mut per_minute = BTreeMap::new();
    for s in steps {
        match *s {
            Step::Admit { edge, who: m } => {
                if only.is_some_and(|o| o != m) {
                    continue;
                }
                let answer = world.admit(edge, m, |ticket, unix_ms| {
                    let mut r = request(ticket, MODELS[m], unix_ms);
                    r.key_limits = key_limits.clone();
                    r.principal_limits = principal_limits.clone();
                    r
                });
                if answer.is_ok() {
                    *per_minute
                        .entry((m, (T0 + world.ms) / MINUTE_MS))
                        .or_default() += 1;
                }
                decisions[m].push(answer);
            }
            Step::Serve { edge, fail } => world.serve(edge, fail),
            Step::Settle { edge, who: m, frac } => {
                world.settle(
                    edge,
                    m,
                    TokenUse {
                        input: 10,
                        output: 20 * frac / 8,
                        ..TokenUse::default()
                    },
                );
            }
            Step::Tick { ms } => world.tick(ms),
        }
    }
    (decisions, per_minute)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// R-TEN-1: without a key's or a principal's rate in all, one
    /// model's use never changes another model's admission (the answers,
    /// refusals included, are those of a world with that model's traffic
    /// alone), on any number of Edges, with claims answered late or
    /// failing.
    #[test]
    fn r_ten_1_one_models_use_never_changes_another_models_admission(
        edges in 1..=4usize,
        steps in prop::collection::vec(step(), 1..300),
    ) {
        let (together, _) = world(edges, &steps, None);
        for m in 0..MODELS.len() {
            let (alone, _) = world(edges, &steps, Some(m));
            prop_assert_eq!(&together[m], &alone[m]);
        }
    }

    /// R-TEN-1, R-TEN-3: a model's requests per minute stay within its
    /// tightest limit plus one chunk per Edge, plus (while the store is
    /// down) each Edge's local share.
    #[test]
    fn r_ten_3_a_models_rate_holds_across_edges_within_the_bound(
        edges in 1..=4usize,
        steps in prop::collection::vec(step(), 1..400),
    ) {
        let (_, per_minute) = world(edges, &steps, None);
        let n = edges as u64;
        for ((m, minute), admitted) in &per_minute {
            let limit = if *m == 1 { MODEL_RPM / 2 } else { MODEL_RPM };
            let chunk = ((limit as f64 * 0.1) as u64).max(1);
            let share = (limit as f64 * 0.5) as u64;
            prop_assert!(
                *admitted <= limit + n * (chunk + share),
                "model {m} minute {minute}: {admitted} admitted"
            );
        }
    }
}
