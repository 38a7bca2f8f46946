//! Admission while a claim is on its way to a slow store (R-TEN-1,
//! R-TEN-3): with a small limit the chunk an Edge claims is one request, so
//! a second request before the store answers the first chunk's claim is
//! short on this Edge's holding, not on the window. It waits for the
//! claim and is admitted, never a 429 while the window has room; when the
//! store does not answer within the wait, the 429's
//! `x-ratelimit-remaining-requests` claims no room.

use std::sync::Arc;

use iop_core::tenant::keys::KeyRecord;
use iop_core::tenant::usage::{UsageKey, UsageQuery, UsageTotals};
use iop_core::tenant::{CounterKey, Held, Limits, TenantsConfig};
use iop_edge::tenancy::{Tenancy, TenantAsk};
use iop_store::BoxFuture;
use iop_store::tenant::{MemoryTenantStore, TenantStore, TenantStoreError, UsageWriteError};
use iop_trace::TraceFiles;
use iop_transport::clock::Clock;
use tokio::sync::Semaphore;

/// A tenant store whose claims wait for a permit the test gives (a store
/// slow to answer, deterministically).
struct SlowClaims {
    inner: MemoryTenantStore,
    gate: Semaphore,
}

impl TenantStore for SlowClaims {
    fn claim(
        &self,
        counter: CounterKey,
        amount: u64,
        limit: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            let permit = self.gate.acquire().await;
            let answer = self.inner.claim(counter, amount, limit).await;
            drop(permit);
            answer
        })
    }
    fn claimed(&self, counter: CounterKey) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        self.inner.claimed(counter)
    }
    fn hold_slots(
        &self,
        ask: iop_core::tenant::slots::SlotAsk,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        self.inner.hold_slots(ask)
    }
    fn give_back(
        &self,
        counter: CounterKey,
        holder: String,
        amount: u64,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<iop_core::tenant::GiveBackOutcome, TenantStoreError>> {
        self.inner.give_back(counter, holder, amount, now_unix_ms)
    }
    fn slots(
        &self,
        counter: CounterKey,
    ) -> BoxFuture<'_, Result<iop_core::tenant::slots::SlotBook, TenantStoreError>> {
        self.inner.slots(counter)
    }
    fn add_usage(
        &self,
        rows: Vec<(UsageKey, UsageTotals)>,
    ) -> BoxFuture<'_, Result<(), UsageWriteError>> {
        self.inner.add_usage(rows)
    }
    fn usage(
        &self,
        query: UsageQuery,
    ) -> BoxFuture<'_, Result<Vec<(UsageKey, UsageTotals)>, TenantStoreError>> {
        self.inner.usage(query)
    }
    fn put_key(
        &self,
        record: KeyRecord,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        self.inner.put_key(record, expected)
    }
    fn key(&self, id: String) -> BoxFuture<'_, Result<Option<(KeyRecord, u64)>, TenantStoreError>> {
        self.inner.key(id)
    }
    fn keys(&self) -> BoxFuture<'_, Result<Vec<(KeyRecord, u64)>, TenantStoreError>> {
        self.inner.keys()
    }
    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, TenantStoreError>> {
        self.inner.sweep(now_unix_ms)
    }
}

fn tenancy() -> (Arc<Tenancy>, Arc<SlowClaims>) {
    let store = Arc::new(SlowClaims {
        inner: MemoryTenantStore::new(),
        gate: Semaphore::new(0),
    });
    let tenancy = Arc::new(Tenancy::new(
        TenantsConfig::default(),
        Clock::new(),
        100,
        store.clone(),
        &TraceFiles::off(),
    ));
    (tenancy, store)
}

fn ask<'a>(limits: &'a Limits, none: &'a Limits) -> TenantAsk<'a> {
    TenantAsk {
        key_id: "k1",
        key_limits: limits,
        principal: "p1",
        principal_limits: none,
        model: "m",
        price: None,
        body_bytes: 100,
        max_output: Some(10),
        durable: false,
        background: false,
        held: (Held::default(), Held::default()),
    }
}

/// The minute has at least 5 s left, so every request of a test counts in
/// one window.
fn early_in_a_minute() {
    let into = iop_transport::clock::unix_ms() % 60_000;
    if into > 55_000 {
        std::thread::sleep(std::time::Duration::from_millis(60_000 - into));
    }
}

fn header(err: &iop_edge::api::ApiError, name: &str) -> Option<String> {
    err.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

#[tokio::test]
async fn r_ten_1_a_request_while_the_first_chunks_claim_is_on_its_way_is_admitted_not_429() {
    early_in_a_minute();
    let (tenancy, store) = tenancy();
    let limits = Limits {
        requests_per_minute: Some(5),
        ..Limits::default()
    };
    let none = Limits::default();
    let first = tenancy
        .admit(&ask(&limits, &none))
        .await
        .expect("on credit");
    // The first chunk's claim is held at the store: the second request is
    // short on this Edge's holding while the window has 4 left.
    let second_ask = ask(&limits, &none);
    let second = tenancy.admit(&second_ask);
    tokio::pin!(second);
    assert!(
        futures::poll!(second.as_mut()).is_pending(),
        "refused while the claim is on its way: a 429 the window does not justify"
    );
    store.gate.add_permits(100);
    let second = second.await.expect("admitted once the store answered");
    assert_eq!(second.headers.requests.map(|(limit, ..)| limit), Some(5));
    drop((first, second));
}

#[tokio::test(start_paused = true)]
async fn r_ten_1_a_claim_the_store_does_not_answer_in_time_refuses_without_showing_room() {
    early_in_a_minute();
    let (tenancy, _store) = tenancy();
    let limits = Limits {
        requests_per_minute: Some(5),
        ..Limits::default()
    };
    let none = Limits::default();
    let _first = tenancy
        .admit(&ask(&limits, &none))
        .await
        .expect("on credit");
    // The store never answers: after the bounded wait the refusal stands.
    let err = tenancy
        .admit(&ask(&limits, &none))
        .await
        .expect_err("no claim answered within the wait");
    assert_eq!(err.status, 429);
    assert_eq!(err.code, Some("rate_limit_exceeded"));
    assert_eq!(err.retry_after_secs, Some(1));
    assert_eq!(
        header(&err, "x-ratelimit-remaining-requests").as_deref(),
        Some("0"),
        "a refusal on this Edge's holding shows no room: {:?}",
        err.headers
    );
    assert_eq!(
        header(&err, "x-ratelimit-limit-requests").as_deref(),
        Some("5")
    );
}
