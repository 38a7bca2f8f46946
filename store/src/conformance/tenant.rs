//! The behaviours every [`TenantStore`] shows, whatever its engine:
//! claims decided by [`check_claim`](iop_core::tenant::check_claim) under
//! any concurrency (R-TEN-3), a stopping Edge's give-backs applied once
//! each ([`check_give_back`](iop_core::tenant::check_give_back)), usage
//! rows (R-TEN-5), runtime keys with
//! revisions (R-TEN-4), and what a sweep forgets.
//!
//! Each behaviour gets a fresh store from the caller's factory:
//!
//! ```ignore
//! #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//! async fn my_tenant_store_conforms() {
//!     iop_store::conformance::tenant::run_all(|| async { my_store() }).await;
//! }
//! ```
//!
//! A store durable across a restart also runs [`write_before_reopen`] then
//! [`check_after_reopen`] on the store opened again; a store shared by
//! several Edges runs [`stores_share_claims_usage_and_keys`] on two
//! instances (two connections) of one deployment.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use iop_core::tenant::keys::{KeyRecord, key_id};
use iop_core::tenant::slots::SlotAsk;
use iop_core::tenant::usage::{UsageKey, UsageQuery, UsageTotals};
use iop_core::tenant::{
    CounterKey, DAY_MS, GiveBackOutcome, Limits, MAX_GIVE_BACKS, MINUTE_MS, Meter, ModelLimits,
    Subject,
};

use crate::BoxFuture;
use crate::tenant::{TenantStore, TenantStoreError};

/// One behaviour: its name and the check.
pub struct Behaviour {
    /// The behaviour, as a sentence in snake case.
    pub name: &'static str,
    /// Run it against a fresh store.
    pub run: fn(Arc<dyn TenantStore>) -> BoxFuture<'static, ()>,
}

/// Every behaviour.
pub fn behaviours() -> Vec<Behaviour> {
    macro_rules! behaviour {
        ($name:ident) => {
            Behaviour {
                name: stringify!($name),
                run: |store| Box::pin($name(store)),
            }
        };
    }
    vec![
        behaviour!(a_claim_gets_what_is_left_of_the_limit_and_claimed_reads_it_back),
        behaviour!(concurrent_claimers_never_claim_past_the_limit),
        behaviour!(usage_adds_sum_per_row_and_queries_filter_by_day_principal_key_and_max_rows),
        behaviour!(a_key_is_written_only_over_its_stored_revision),
        behaviour!(sweep_forgets_windows_that_are_over_and_keeps_a_total_budget),
        behaviour!(per_model_counters_are_apart_and_a_keys_limits_per_model_are_kept),
        behaviour!(slot_holders_racing_never_hold_past_the_limit_and_a_lapsed_holders_come_back),
        behaviour!(a_retried_give_back_frees_once_never_below_zero_nor_after_its_window),
        behaviour!(claims_and_retried_give_backs_racing_never_pass_the_limit),
    ]
}

/// Run every behaviour, each on a fresh store from `make`.
pub async fn run_all<F, Fut>(mut make: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Arc<dyn TenantStore>>,
{
    for behaviour in behaviours() {
        eprintln!("tenant conformance: {}", behaviour.name);
        (behaviour.run)(make().await).await;
    }
}

/// A realistic "now": some day in 2024, Unix ms.
pub const NOW_UNIX_MS: u64 = 19_800 * DAY_MS + 12 * 3_600_000;

fn minute(unix_ms: u64) -> u64 {
    unix_ms - unix_ms % MINUTE_MS
}

/// The counter of `subject`'s `meter` in the window starting at `window`.
pub fn counter(subject: Subject, meter: Meter, window: u64) -> CounterKey {
    CounterKey {
        subject,
        meter,
        window_unix_ms: window,
    }
}

fn requests_of(key: &str) -> CounterKey {
    counter(
        Subject::Key(key.into()),
        Meter::Requests,
        minute(NOW_UNIX_MS),
    )
}

/// A runtime key `id` of `principal`, as the admin API would store it.
pub fn key_record(id: &str, principal: &str, name: &str) -> KeyRecord {
    KeyRecord {
        id: id.into(),
        principal: principal.into(),
        name: Some(name.into()),
        secret_sha256: "ab".repeat(32),
        models: vec!["*".into()],
        limits: Limits {
            requests_per_minute: Some(60),
            ..Limits::default()
        },
        expires_unix_ms: None,
        revoked_unix_ms: None,
        created_unix_ms: NOW_UNIX_MS,
        updated_unix_ms: NOW_UNIX_MS,
    }
}

fn usage_key(day: u64, principal: &str, key: &str, model: &str) -> UsageKey {
    UsageKey {
        day_unix_ms: day * DAY_MS,
        principal: principal.into(),
        key: key.into(),
        model: model.into(),
    }
}

fn totals(requests: u64, input: u64, spend: u64) -> UsageTotals {
    UsageTotals {
        requests,
        input_tokens: input,
        cached_input_tokens: input / 2,
        output_tokens: 2 * input,
        spend_micros: spend,
    }
}

fn query(from_day: u64, to_day: u64) -> UsageQuery {
    UsageQuery {
        from_day_unix_ms: from_day * DAY_MS,
        to_day_unix_ms: to_day * DAY_MS,
        principal: None,
        key: None,
        max_rows: 1000,
    }
}

fn rows_of(rows: &[(UsageKey, UsageTotals)]) -> Vec<(u64, &str, &str, &str)> {
    rows.iter()
        .map(|(k, _)| {
            (
                k.day_unix_ms / DAY_MS,
                k.principal.as_str(),
                k.key.as_str(),
                k.model.as_str(),
            )
        })
        .collect()
}

/// R-TEN-3: a claim gets what is left of the limit, never more; an
/// exhausted window grants 0 and stays at the limit; counters of another
/// subject, meter or window are apart.
pub async fn a_claim_gets_what_is_left_of_the_limit_and_claimed_reads_it_back(
    store: Arc<dyn TenantStore>,
) {
    let s = &*store;
    let c = requests_of("key-a");
    assert_eq!(s.claimed(c.clone()).await, Ok(0));
    assert_eq!(s.claim(c.clone(), 30, 100).await, Ok(30));
    assert_eq!(s.claimed(c.clone()).await, Ok(30));
    assert_eq!(s.claim(c.clone(), 80, 100).await, Ok(70), "what is left");
    assert_eq!(s.claim(c.clone(), 1, 100).await, Ok(0), "exhausted");
    assert_eq!(s.claim(c.clone(), 0, 100).await, Ok(0));
    assert_eq!(s.claimed(c.clone()).await, Ok(100));
    assert_eq!(
        s.claim(c.clone(), 10, 120).await,
        Ok(10),
        "a raised limit leaves room again"
    );
    assert_eq!(
        s.claim(c.clone(), 10, 50).await,
        Ok(0),
        "a lowered one none"
    );
    assert_eq!(s.claimed(c.clone()).await, Ok(110));

    let others = [
        requests_of("key-b"),
        counter(
            Subject::Principal("key-a".into()),
            Meter::Requests,
            c.window_unix_ms,
        ),
        counter(
            Subject::Key("key-a".into()),
            Meter::Tokens,
            c.window_unix_ms,
        ),
        counter(
            Subject::Key("key-a".into()),
            Meter::Requests,
            c.window_unix_ms + MINUTE_MS,
        ),
    ];
    for other in others {
        assert_eq!(s.claimed(other.clone()).await, Ok(0), "{other:?}");
        assert_eq!(s.claim(other.clone(), 5, 100).await, Ok(5), "{other:?}");
    }
    assert_eq!(s.claimed(c).await, Ok(110));
}

/// How many claimers race in [`concurrent_claimers_never_claim_past_the_limit`].
pub const CLAIMERS: usize = 16;

/// Claim `chunk` of `counter` until the store grants nothing: the total.
async fn claim_until_exhausted(
    store: Arc<dyn TenantStore>,
    counter: CounterKey,
    chunk: u64,
    limit: u64,
) -> u64 {
    let mut got = 0;
    loop {
        match store.claim(counter.clone(), chunk, limit).await {
            Ok(0) => return got,
            Ok(granted) => {
                assert!(granted <= chunk, "granted {granted} of a claim of {chunk}");
                got += granted;
            }
            Err(e) => panic!("a claim failed: {e}"),
        }
    }
}

/// R-TEN-3: claimers racing on one counter get exactly the limit between
/// them, never more, whoever wins each race.
pub async fn concurrent_claimers_never_claim_past_the_limit(store: Arc<dyn TenantStore>) {
    race_claims(&[store], requests_of("raced"), 7, 500).await;
}

/// [`CLAIMERS`] tasks, spread over `stores`, claim `chunk` of `counter`
/// until it is exhausted: they get `limit` between them, and every store
/// reads the counter at the limit.
pub async fn race_claims(
    stores: &[Arc<dyn TenantStore>],
    counter: CounterKey,
    chunk: u64,
    limit: u64,
) {
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let store = stores[i % stores.len()].clone();
            tokio::spawn(claim_until_exhausted(store, counter.clone(), chunk, limit))
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("a claimer panicked");
    }
    assert_eq!(total, limit, "claimed between them");
    for store in stores {
        assert_eq!(store.claimed(counter.clone()).await, Ok(limit));
        assert_eq!(store.claim(counter.clone(), 1, limit).await, Ok(0));
    }
}

/// `holder`'s ask to hold `want` of `gauge`'s `limit` slots at
/// `now_unix_ms`, its lease `lease_ms`.
fn slot_ask(
    gauge: CounterKey,
    holder: String,
    want: u64,
    limit: u64,
    now_unix_ms: u64,
    lease_ms: u64,
) -> SlotAsk {
    SlotAsk {
        counter: gauge,
        holder,
        want,
        limit,
        now_unix_ms,
        lease_ms,
    }
}

/// R-TEN-1, R-TEN-3: holders (Edge processes) racing to hold slots of one
/// concurrency gauge never hold more than its limit between them, a
/// holding given back is free at once, an ask is idempotent, and a holder
/// that stops renewing no longer counts once its lease lapsed.
pub async fn slot_holders_racing_never_hold_past_the_limit_and_a_lapsed_holders_come_back(
    store: Arc<dyn TenantStore>,
) {
    let gauge = counter(Subject::Key(key_id(9)), Meter::Slots, 0);
    let lease = 10_000;
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let (store, gauge) = (store.clone(), gauge.clone());
            tokio::spawn(async move {
                store
                    .hold_slots(slot_ask(
                        gauge,
                        format!("edge-{i}"),
                        3,
                        8,
                        NOW_UNIX_MS,
                        lease,
                    ))
                    .await
                    .expect("the store answers")
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("a holder panicked");
    }
    assert_eq!(total, 8, "held between them");
    let book = store.slots(gauge.clone()).await.expect("read");
    assert_eq!(book.total(NOW_UNIX_MS), 8);
    // Asked again: the same, nothing more.
    let (holder, held) = book
        .holders
        .iter()
        .map(|(h, s)| (h.clone(), s.held))
        .next()
        .expect("a holder");
    let again = store
        .hold_slots(slot_ask(
            gauge.clone(),
            holder.clone(),
            held,
            8,
            NOW_UNIX_MS,
            lease,
        ))
        .await;
    assert_eq!(again, Ok(held));
    // Given back: free for another at once.
    assert_eq!(
        store
            .hold_slots(slot_ask(
                gauge.clone(),
                holder.clone(),
                0,
                8,
                NOW_UNIX_MS,
                lease
            ))
            .await,
        Ok(0)
    );
    assert_eq!(
        store
            .hold_slots(slot_ask(
                gauge.clone(),
                "edge-new".into(),
                8,
                8,
                NOW_UNIX_MS,
                lease
            ))
            .await,
        Ok(held)
    );
    // Every other holder stops renewing: after the lease, the new one
    // renewed gets the whole limit.
    let later = NOW_UNIX_MS + lease;
    assert_eq!(
        store
            .hold_slots(slot_ask(
                gauge.clone(),
                "edge-new".into(),
                held,
                8,
                later - 1,
                lease
            ))
            .await,
        Ok(held)
    );
    assert_eq!(
        store
            .hold_slots(slot_ask(
                gauge.clone(),
                "edge-new".into(),
                8,
                8,
                later,
                lease
            ))
            .await,
        Ok(8)
    );
    let book = store.slots(gauge).await.expect("read");
    assert_eq!(book.total(later), 8);
    assert_eq!(book.holders.len(), 1);
}

/// R-TEN-2, R-TEN-3: a stopping Edge's give-back frees what it asks
/// once: sent again (its answer lost) it frees nothing more, also after
/// other Edges claimed in between; never below zero; nothing once the
/// window is over; at most [`MAX_GIVE_BACKS`] holders per counter, the
/// next refused (its allowance stays claimed).
pub async fn a_retried_give_back_frees_once_never_below_zero_nor_after_its_window(
    store: Arc<dyn TenantStore>,
) {
    let s = &*store;
    let c = requests_of("given-back");
    let give = |holder: &str, amount: u64, now: u64| {
        s.give_back(c.clone(), holder.to_owned(), amount, now)
    };
    assert_eq!(s.claim(c.clone(), 300, 1_000).await, Ok(300));
    assert_eq!(
        give("edge-a", 100, NOW_UNIX_MS).await,
        Ok(GiveBackOutcome::Freed(100))
    );
    assert_eq!(s.claimed(c.clone()).await, Ok(200));
    assert_eq!(
        give("edge-a", 100, NOW_UNIX_MS).await,
        Ok(GiveBackOutcome::AlreadyGivenBack),
        "a retry frees nothing more"
    );
    assert_eq!(s.claim(c.clone(), 50, 1_000).await, Ok(50));
    assert_eq!(
        s.claimed(c.clone()).await,
        Ok(250),
        "a claim keeps the record"
    );
    assert_eq!(
        give("edge-a", 100, NOW_UNIX_MS).await,
        Ok(GiveBackOutcome::AlreadyGivenBack),
        "nor after another Edge's claim"
    );
    assert_eq!(s.claimed(c.clone()).await, Ok(250));
    assert_eq!(
        give("edge-b", 1_000, NOW_UNIX_MS).await,
        Ok(GiveBackOutcome::Freed(250)),
        "never below zero"
    );
    assert_eq!(s.claimed(c.clone()).await, Ok(0));
    assert_eq!(s.claim(c.clone(), 2_000, 1_000).await, Ok(1_000));

    // The window is over: nothing changes, nothing is written.
    let over = minute(NOW_UNIX_MS) + MINUTE_MS;
    assert_eq!(
        give("edge-c", 10, over).await,
        Ok(GiveBackOutcome::WindowOver)
    );
    assert_eq!(s.claimed(c.clone()).await, Ok(1_000));
    let past = counter(
        Subject::Key("given-back".into()),
        Meter::Requests,
        minute(NOW_UNIX_MS) - MINUTE_MS,
    );
    assert_eq!(
        s.give_back(past.clone(), "edge-c".into(), 10, NOW_UNIX_MS)
            .await,
        Ok(GiveBackOutcome::WindowOver)
    );
    assert_eq!(s.claimed(past).await, Ok(0));

    // Bounded: past MAX_GIVE_BACKS holders, refused and kept claimed.
    let budget = counter(Subject::Principal("given-back".into()), Meter::Spend, 0);
    let many = MAX_GIVE_BACKS as u64 + 10;
    assert_eq!(s.claim(budget.clone(), many, many).await, Ok(many));
    for i in 0..MAX_GIVE_BACKS {
        assert_eq!(
            s.give_back(budget.clone(), format!("edge-{i}"), 1, NOW_UNIX_MS)
                .await,
            Ok(GiveBackOutcome::Freed(1))
        );
    }
    assert_eq!(
        s.give_back(budget.clone(), "edge-one-more".into(), 1, NOW_UNIX_MS)
            .await,
        Ok(GiveBackOutcome::Full)
    );
    assert_eq!(s.claimed(budget).await, Ok(10));
}

/// R-TEN-2, R-TEN-3: claimers racing on one counter while half of them,
/// stopping, give back what they got (each give-back sent twice at once,
/// as a retry racing the first): each is applied once, the counter always
/// holds what was claimed net of what was freed, and claiming what is left
/// brings it to the limit, never past it.
pub async fn claims_and_retried_give_backs_racing_never_pass_the_limit(
    store: Arc<dyn TenantStore>,
) {
    race_give_backs(&[store], requests_of("given-raced"), 7, 300).await;
}

/// [`CLAIMERS`] tasks spread over `stores` claim `chunk` of `counter`
/// (limit `limit`) four times; every other one then gives back what it
/// got, sent at once through two stores; see
/// [`claims_and_retried_give_backs_racing_never_pass_the_limit`].
pub async fn race_give_backs(
    stores: &[Arc<dyn TenantStore>],
    counter: CounterKey,
    chunk: u64,
    limit: u64,
) {
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let store = stores[i % stores.len()].clone();
            let retry = stores[(i + 1) % stores.len()].clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut got = 0;
                for _ in 0..4 {
                    got += store
                        .claim(counter.clone(), chunk, limit)
                        .await
                        .expect("the store answers");
                }
                if i % 2 == 0 || got == 0 {
                    return (got, 0);
                }
                let holder = format!("edge-{i}");
                let (first, again) = tokio::join!(
                    store.give_back(counter.clone(), holder.clone(), got, NOW_UNIX_MS),
                    retry.give_back(counter.clone(), holder, got, NOW_UNIX_MS),
                );
                let outcomes = [
                    first.expect("the store answers"),
                    again.expect("the store answers"),
                ];
                let freed: Vec<u64> = outcomes
                    .iter()
                    .filter_map(|o| match o {
                        GiveBackOutcome::Freed(n) => Some(*n),
                        _ => None,
                    })
                    .collect();
                assert_eq!(freed.len(), 1, "applied once: {outcomes:?}");
                assert!(
                    outcomes.contains(&GiveBackOutcome::AlreadyGivenBack),
                    "{outcomes:?}"
                );
                (got, freed[0])
            })
        })
        .collect();
    let (mut got, mut freed) = (0, 0);
    for task in tasks {
        let (g, f) = task.await.expect("a claimer panicked");
        got += g;
        freed += f;
    }
    assert!(
        got - freed <= limit,
        "claimed {got}, {freed} of it given back, of {limit}"
    );
    for store in stores {
        assert_eq!(store.claimed(counter.clone()).await, Ok(got - freed));
    }
    let rest = claim_until_exhausted(stores[0].clone(), counter.clone(), chunk, limit).await;
    assert_eq!(
        rest,
        limit - (got - freed),
        "what was given back is claimed again"
    );
    for store in stores {
        assert_eq!(store.claimed(counter.clone()).await, Ok(limit));
    }
}

/// R-TEN-5: each added row sums into its stored row; a read returns the
/// rows of its days, principal and key in key order, at most `max_rows`.
pub async fn usage_adds_sum_per_row_and_queries_filter_by_day_principal_key_and_max_rows(
    store: Arc<dyn TenantStore>,
) {
    let s = &*store;
    let d = NOW_UNIX_MS / DAY_MS;
    assert_eq!(s.usage(query(0, d + 10)).await, Ok(Vec::new()));
    s.add_usage(vec![
        (usage_key(d, "p1", "k1", "m1"), totals(1, 10, 100)),
        (usage_key(d, "p1", "k2", "m1"), totals(1, 20, 200)),
        (usage_key(d + 1, "p2", "k3", "m1"), totals(2, 30, 300)),
    ])
    .await
    .unwrap();
    s.add_usage(vec![
        (usage_key(d, "p1", "k1", "m1"), totals(1, 5, 50)),
        (usage_key(d + 1, "p1", "k1", "m.2/x"), totals(1, 1, 1)),
        (usage_key(d + 2, "p2", "k3", "m1"), totals(1, 1, 1)),
    ])
    .await
    .unwrap();
    s.add_usage(Vec::new()).await.unwrap();

    let all = s.usage(query(d, d + 2)).await.unwrap();
    assert_eq!(
        rows_of(&all),
        [
            (d, "p1", "k1", "m1"),
            (d, "p1", "k2", "m1"),
            (d + 1, "p1", "k1", "m.2/x"),
            (d + 1, "p2", "k3", "m1"),
            (d + 2, "p2", "k3", "m1"),
        ],
        "every row once, in key order"
    );
    assert_eq!(all[0].1, {
        let mut sum = totals(1, 10, 100);
        sum.add(&totals(1, 5, 50));
        sum
    });
    assert_eq!(all[3].1, totals(2, 30, 300));

    let days = s.usage(query(d + 1, d + 1)).await.unwrap();
    assert_eq!(
        rows_of(&days),
        [(d + 1, "p1", "k1", "m.2/x"), (d + 1, "p2", "k3", "m1")]
    );
    let mut by_principal = query(d, d + 2);
    by_principal.principal = Some("p2".into());
    assert_eq!(
        rows_of(&s.usage(by_principal).await.unwrap()),
        [(d + 1, "p2", "k3", "m1"), (d + 2, "p2", "k3", "m1")]
    );
    let mut by_key = query(d, d + 2);
    by_key.key = Some("k1".into());
    assert_eq!(
        rows_of(&s.usage(by_key.clone()).await.unwrap()),
        [(d, "p1", "k1", "m1"), (d + 1, "p1", "k1", "m.2/x")]
    );
    by_key.principal = Some("p2".into());
    assert_eq!(s.usage(by_key).await, Ok(Vec::new()));
    let mut first_two = query(d, d + 2);
    first_two.max_rows = 2;
    assert_eq!(
        rows_of(&s.usage(first_two).await.unwrap()),
        [(d, "p1", "k1", "m1"), (d, "p1", "k2", "m1")],
        "the first rows in key order"
    );
    let mut none = query(d, d + 2);
    none.max_rows = 0;
    assert_eq!(s.usage(none).await, Ok(Vec::new()));
    assert_eq!(s.usage(query(d + 3, d + 9)).await, Ok(Vec::new()));
    assert_eq!(s.usage(query(d + 2, d)).await, Ok(Vec::new()));
}

/// R-TEN-4: a key is written only over the revision its writer read (0:
/// none stored), every write makes a greater revision, and reads return
/// what is stored.
pub async fn a_key_is_written_only_over_its_stored_revision(store: Arc<dyn TenantStore>) {
    let s = &*store;
    let id = key_id(1);
    assert_eq!(s.key(id.clone()).await, Ok(None));
    assert_eq!(s.keys().await, Ok(Vec::new()));
    let record = key_record(&id, "team-a", "ci");
    let first = s.put_key(record.clone(), 0).await.unwrap();
    assert!(first > 0);
    assert_eq!(
        s.put_key(record.clone(), 0).await,
        Err(TenantStoreError::Conflict { current: first }),
        "a second creator is refused"
    );
    let mut revoked = record.clone();
    revoked.revoked_unix_ms = Some(NOW_UNIX_MS + 1);
    revoked.updated_unix_ms = NOW_UNIX_MS + 1;
    let second = s.put_key(revoked.clone(), first).await.unwrap();
    assert!(second > first, "{second} after {first}");
    assert_eq!(
        s.put_key(record.clone(), first).await,
        Err(TenantStoreError::Conflict { current: second }),
        "a writer that read an old revision is refused"
    );
    assert_eq!(s.key(id.clone()).await, Ok(Some((revoked.clone(), second))));

    let other_id = key_id(0);
    let other = key_record(&other_id, "team-b", "batch");
    let third = s.put_key(other.clone(), 0).await.unwrap();
    assert!(third > second, "revisions grow across keys too");
    assert_eq!(
        s.keys().await,
        Ok(vec![(other, third), (revoked, second)]),
        "every key, by id"
    );
    assert_eq!(s.key(key_id(2)).await, Ok(None));
}

/// A key's limits per model (R-TEN-1): with one.
pub fn key_record_with_model_limits(id: &str, principal: &str) -> KeyRecord {
    let mut record = key_record(id, principal, "per-model");
    for (model, rpm) in [("gpt-4o", 3), ("llama3:8b", 5)] {
        record.limits.per_model.insert(
            model.into(),
            ModelLimits {
                requests_per_minute: Some(rpm),
                tokens_per_minute: Some(1_000),
                concurrent_requests: None,
            },
        );
    }
    record
}

/// R-TEN-1, R-TEN-3: a counter per key or principal and model is apart
/// from the whole one, from another model's and from another subject's
/// (whatever characters the names hold), and swept like the others;
/// R-TEN-4: a key's limits per model are stored and read back, and a
/// revoked key reads revoked.
pub async fn per_model_counters_are_apart_and_a_keys_limits_per_model_are_kept(
    store: Arc<dyn TenantStore>,
) {
    let s = &*store;
    let window = minute(NOW_UNIX_MS);
    let key_model = |key: &str, model: &str| Subject::KeyModel {
        key: key.into(),
        model: model.into(),
    };
    let principal_model = |principal: &str, model: &str| Subject::PrincipalModel {
        principal: principal.into(),
        model: model.into(),
    };
    let long = "m".repeat(300);
    let subjects = [
        key_model("key-a", "gpt-4o"),
        key_model("key-a", "llama3:8b"),
        key_model("key-a", "org/m.2"),
        key_model("key-a", &long),
        key_model("key-a.gpt-4o", ""),
        key_model("key-b", "gpt-4o"),
        principal_model("key-a", "gpt-4o"),
        Subject::Key("key-a".into()),
        Subject::Principal("key-a".into()),
    ];
    for (i, subject) in subjects.iter().enumerate() {
        let c = counter(subject.clone(), Meter::Requests, window);
        assert_eq!(s.claimed(c.clone()).await, Ok(0), "{subject:?}");
        let amount = i as u64 + 1;
        assert_eq!(
            s.claim(c.clone(), amount, 100).await,
            Ok(amount),
            "{subject:?}"
        );
    }
    for (i, subject) in subjects.iter().enumerate() {
        let c = counter(subject.clone(), Meter::Requests, window);
        assert_eq!(s.claimed(c).await, Ok(i as u64 + 1), "{subject:?}");
    }
    let tokens = counter(key_model("key-a", "gpt-4o"), Meter::Tokens, window);
    assert_eq!(s.claim(tokens.clone(), 500, 400).await, Ok(400));
    assert_eq!(s.claim(tokens.clone(), 1, 400).await, Ok(0), "exhausted");
    assert!(s.sweep(window + 2 * MINUTE_MS).await.unwrap() >= subjects.len());
    assert_eq!(s.claimed(tokens).await, Ok(0), "forgotten with its window");

    let id = key_id(5);
    let record = key_record_with_model_limits(&id, "team-a");
    let first = s.put_key(record.clone(), 0).await.unwrap();
    assert_eq!(s.key(id.clone()).await, Ok(Some((record.clone(), first))));
    assert_eq!(s.keys().await, Ok(vec![(record.clone(), first)]));
    let mut revoked = record;
    revoked.revoked_unix_ms = Some(NOW_UNIX_MS + 1);
    let second = s.put_key(revoked.clone(), first).await.unwrap();
    let (read, revision) = s.key(id).await.unwrap().expect("stored");
    assert_eq!(revision, second);
    assert_eq!(read.revoked_unix_ms, Some(NOW_UNIX_MS + 1), "revoked");
    assert_eq!(
        read.limits.requests_per_minute, revoked.limits.requests_per_minute,
        "its whole limits kept (those per model never apply again)"
    );
}

/// What a sweep forgets: a minute's counters two minutes after it began,
/// a budget period's once it is over, usage rows past retention (a store
/// may leave those to its engine's own expiry); never a budget in total,
/// a window still running or a recent usage row.
pub async fn sweep_forgets_windows_that_are_over_and_keeps_a_total_budget(
    store: Arc<dyn TenantStore>,
) {
    let s = &*store;
    let now = NOW_UNIX_MS;
    let who = || Subject::Principal("team-a".into());
    let this_minute = counter(who(), Meter::Tokens, minute(now));
    let next_minute = counter(who(), Meter::Requests, minute(now) + MINUTE_MS);
    let today = now - now % DAY_MS;
    let day_budget = counter(who(), Meter::Spend, today);
    let total_budget = counter(who(), Meter::Spend, 0);
    for c in [&this_minute, &next_minute, &day_budget, &total_budget] {
        assert_eq!(s.claim(c.clone(), 10, 1_000).await, Ok(10), "{c:?}");
    }
    let row = usage_key(today / DAY_MS, "team-a", "k", "m");
    s.add_usage(vec![(row.clone(), totals(1, 1, 1))])
        .await
        .unwrap();
    let claimed = |c: &CounterKey| s.claimed(c.clone());

    s.sweep(minute(now) + MINUTE_MS).await.unwrap();
    assert_eq!(claimed(&this_minute).await, Ok(10), "not over for long yet");
    assert_eq!(claimed(&next_minute).await, Ok(10));
    assert!(s.sweep(minute(now) + 2 * MINUTE_MS).await.unwrap() >= 1);
    assert_eq!(claimed(&this_minute).await, Ok(0), "forgotten");
    assert_eq!(claimed(&next_minute).await, Ok(10), "still running");
    assert_eq!(claimed(&day_budget).await, Ok(10));
    assert_eq!(
        s.claim(this_minute.clone(), 5, 1_000).await,
        Ok(5),
        "a forgotten counter starts again from nothing"
    );

    let month_later = today + 31 * DAY_MS;
    assert!(s.sweep(month_later).await.unwrap() >= 2);
    assert_eq!(claimed(&day_budget).await, Ok(0), "its period is over");
    assert_eq!(claimed(&next_minute).await, Ok(0));
    assert_eq!(claimed(&total_budget).await, Ok(10), "kept for good");
    assert_eq!(
        rows_of(&s.usage(query(0, u64::MAX / DAY_MS)).await.unwrap()),
        [(today / DAY_MS, "team-a", "k", "m")],
        "a usage row within retention stays"
    );
    s.sweep(u64::MAX).await.unwrap();
    assert_eq!(claimed(&total_budget).await, Ok(10), "kept for good");
}

/// The state [`write_before_reopen`] leaves.
fn reopen_counter() -> CounterKey {
    counter(Subject::Key(key_id(7)), Meter::Spend, 0)
}

/// For a store durable across a restart: claims, usage and a key, each
/// durable when its call returned; [`check_after_reopen`] finds them in
/// the store opened again.
pub async fn write_before_reopen(store: Arc<dyn TenantStore>) {
    let s = &*store;
    assert_eq!(s.claim(reopen_counter(), 500, 1_000).await, Ok(500));
    assert_eq!(
        s.give_back(reopen_counter(), "edge-stopped".into(), 100, NOW_UNIX_MS)
            .await,
        Ok(GiveBackOutcome::Freed(100))
    );
    s.add_usage(vec![(
        usage_key(NOW_UNIX_MS / DAY_MS, "team-a", &key_id(7), "m"),
        totals(3, 30, 300),
    )])
    .await
    .unwrap();
    let revision = s
        .put_key(key_record(&key_id(7), "team-a", "ci"), 0)
        .await
        .unwrap();
    assert!(revision > 0);
    s.put_key(key_record_with_model_limits(&key_id(8), "team-a"), 0)
        .await
        .unwrap();
}

/// See [`write_before_reopen`]: a budget's spend, the usage rows and the
/// keys survived, and key revisions keep growing.
pub async fn check_after_reopen(store: Arc<dyn TenantStore>) {
    let s = &*store;
    assert_eq!(s.claimed(reopen_counter()).await, Ok(400));
    assert_eq!(
        s.give_back(reopen_counter(), "edge-stopped".into(), 100, NOW_UNIX_MS)
            .await,
        Ok(GiveBackOutcome::AlreadyGivenBack),
        "who gave back survived too"
    );
    assert_eq!(
        s.claim(reopen_counter(), 1_000, 1_000).await,
        Ok(600),
        "the budget's spend survived"
    );
    let rows = s
        .usage(query(NOW_UNIX_MS / DAY_MS, NOW_UNIX_MS / DAY_MS))
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1, totals(3, 30, 300));
    let (record, revision) = s.key(key_id(7)).await.unwrap().expect("the key survived");
    assert_eq!(record, key_record(&key_id(7), "team-a", "ci"));
    assert_eq!(s.keys().await.unwrap().len(), 2);
    let (limited, _) = s.key(key_id(8)).await.unwrap().expect("the key survived");
    assert_eq!(
        limited,
        key_record_with_model_limits(&key_id(8), "team-a"),
        "with its limits per model"
    );
    let next = s.put_key(record, revision).await.unwrap();
    assert!(
        next > revision,
        "revisions keep growing: {next} after {revision}"
    );
}

/// How long [`stores_share_claims_usage_and_keys`] waits for a key to show
/// in another instance's listing.
pub const KEY_SYNC_WAIT: Duration = Duration::from_secs(10);

/// For a store shared by several Edges, on two instances `a` and `b` of
/// one deployment: claims racing on both never pass the limit between
/// them, each sees the other's claims, usage and keys (a key at once by
/// id, in the listing within [`KEY_SYNC_WAIT`]), and a key write over a
/// revision the other replaced is refused.
pub async fn stores_share_claims_usage_and_keys(a: Arc<dyn TenantStore>, b: Arc<dyn TenantStore>) {
    race_claims(&[a.clone(), b.clone()], requests_of("shared"), 3, 300).await;
    race_give_backs(&[a.clone(), b.clone()], requests_of("shared-given"), 7, 300).await;
    let c = requests_of("seen");
    assert_eq!(a.claim(c.clone(), 40, 100).await, Ok(40));
    assert_eq!(b.claimed(c.clone()).await, Ok(40));
    assert_eq!(b.claim(c.clone(), 100, 100).await, Ok(60));
    assert_eq!(a.claimed(c).await, Ok(100));

    let row = usage_key(NOW_UNIX_MS / DAY_MS, "team-a", "k", "m");
    a.add_usage(vec![(row.clone(), totals(1, 10, 10))])
        .await
        .unwrap();
    b.add_usage(vec![(row.clone(), totals(2, 20, 20))])
        .await
        .unwrap();
    let day = NOW_UNIX_MS / DAY_MS;
    for s in [&a, &b] {
        let rows = s.usage(query(day, day)).await.unwrap();
        assert_eq!(rows, vec![(row.clone(), totals(3, 30, 30))]);
    }

    let id = key_id(42);
    let record = key_record(&id, "team-a", "shared");
    let revision = a.put_key(record.clone(), 0).await.unwrap();
    assert_eq!(
        b.key(id.clone()).await,
        Ok(Some((record.clone(), revision)))
    );
    let deadline = tokio::time::Instant::now() + KEY_SYNC_WAIT;
    while !b
        .keys()
        .await
        .unwrap()
        .contains(&(record.clone(), revision))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the key did not show in the other instance's listing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut renamed = record.clone();
    renamed.name = Some("renamed".into());
    let newer = b.put_key(renamed.clone(), revision).await.unwrap();
    assert_eq!(
        a.put_key(record, revision).await,
        Err(TenantStoreError::Conflict { current: newer })
    );
    assert_eq!(a.key(id).await, Ok(Some((renamed, newer))));
}
