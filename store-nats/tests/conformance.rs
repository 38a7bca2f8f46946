//! The store-agnostic conformance suite (R-JRN-1..5, R-IDEM-1), run
//! against a real nats-server.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};

use iop_store_nats::NatsStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_store_conforms() {
    let Some(server) = support::NatsServer::start() else {
        return;
    };
    let url = server.url();
    let next = AtomicUsize::new(0);
    iop_store::conformance::run_all(|limits| {
        let name = format!("c{}", next.fetch_add(1, Ordering::Relaxed));
        let options = support::options(&url, &name, limits);
        async move {
            NatsStore::connect(options)
                .await
                .unwrap_or_else(|e| panic!("connect: {e}"))
        }
    })
    .await;
}

/// The same with the smallest messages the store writes: every request
/// and most appends span several messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_store_conforms_with_appends_split_over_many_messages() {
    let Some(server) = support::NatsServer::start() else {
        return;
    };
    let url = server.url();
    let next = AtomicUsize::new(0);
    iop_store::conformance::run_all(|limits| {
        let name = format!("s{}", next.fetch_add(1, Ordering::Relaxed));
        let mut options = support::options(&url, &name, limits);
        options.max_message_bytes = Some(iop_store_nats::MIN_MESSAGE_BYTES);
        async move {
            NatsStore::connect(options)
                .await
                .unwrap_or_else(|e| panic!("connect: {e}"))
        }
    })
    .await;
}
