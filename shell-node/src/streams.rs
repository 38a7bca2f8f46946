//! A connection's data streams, each accepted by the task that serves it.
//!
//! One task at a time waits in `accept_bi` (quinn wakes every task waiting
//! there when a stream arrives, so more would only be woken for nothing).
//! The task that accepts a stream first hands the waiting on to a new task,
//! then serves the stream itself ([`run::serve_stream`]): a run starts on
//! the task quinn woke for its stream, with neither the connection's link
//! task nor a spawn between the accept and the run.
//!
//! Every one of these tasks is in the connection's set, so the
//! connection's end cancels them all, the waiting one included (R-DISC-1;
//! a durable run is not in it: it runs in a task of its own, R-PARK-1).
//! The streams in flight stay bounded by the connection's stream limit
//! (one task each, none while no stream is open but the one waiting).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use iop_transport::framed::framed_for_side;
use tokio::task::JoinSet;

use crate::control::LinkTx;
use crate::run;
use crate::state::LinkShared;

/// The tasks serving one connection's data streams (see the module docs).
pub(crate) struct Streams(Arc<Inner>);

struct Inner {
    conn: quinn::Connection,
    link: LinkTx,
    shared: Arc<LinkShared>,
    /// The connection's generation (set at readiness).
    generation: u64,
    tasks: Mutex<Tasks>,
    /// Tasks serving a stream now (not the one waiting for the next).
    serving: AtomicU64,
}

struct Tasks {
    set: JoinSet<()>,
    /// The connection ended: no task starts any more.
    closed: bool,
}

impl Streams {
    /// Start accepting `conn`'s data streams, once it completed readiness
    /// under `generation`.
    pub(crate) fn start(
        conn: quinn::Connection,
        link: LinkTx,
        shared: Arc<LinkShared>,
        generation: u64,
    ) -> Self {
        let inner = Arc::new(Inner {
            conn,
            link,
            shared,
            generation,
            tasks: Mutex::new(Tasks {
                set: JoinSet::new(),
                closed: false,
            }),
            serving: AtomicU64::new(0),
        });
        Inner::wait_for_next(&inner);
        Self(inner)
    }

    /// The connection ended: every task is canceled (R-DISC-1) and none
    /// starts any more. Returns how many were serving a stream.
    pub(crate) fn close(&self) -> u64 {
        let set = {
            let mut tasks = self.0.tasks();
            tasks.closed = true;
            std::mem::take(&mut tasks.set)
        };
        let serving = self.0.serving.load(Ordering::Relaxed);
        // Dropping the set aborts every task in it.
        drop(set);
        serving
    }
}

impl Drop for Streams {
    /// A link task dropped before it ended (the process aborted) cancels
    /// the tasks too: they hold the connection.
    fn drop(&mut self) {
        self.close();
    }
}

impl Inner {
    fn tasks(&self) -> MutexGuard<'_, Tasks> {
        // Each change is one push or take; a panic cannot leave it half done.
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Start the task that waits for the next stream (unless the
    /// connection ended), and let go of the tasks that ended.
    fn wait_for_next(inner: &Arc<Self>) {
        let mut tasks = inner.tasks();
        if tasks.closed {
            return;
        }
        while tasks.set.try_join_next().is_some() {}
        tasks.set.spawn(accept_and_serve(Arc::clone(inner)));
    }
}

/// Counts a task as serving a stream while it lives.
struct Serving<'a>(&'a AtomicU64);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Wait for the next data stream, hand the waiting on, serve the stream.
async fn accept_and_serve(inner: Arc<Inner>) {
    // An error is the connection's end, which the link task sees itself.
    let Ok((send, recv)) = inner.conn.accept_bi().await else {
        return;
    };
    Inner::wait_for_next(&inner);
    inner.serving.fetch_add(1, Ordering::Relaxed);
    let _serving = Serving(&inner.serving);
    let (send, recv) = framed_for_side(inner.conn.side(), send, recv);
    run::serve_stream(
        send,
        recv,
        inner.link.clone(),
        Arc::clone(&inner.shared),
        inner.conn.clone(),
        inner.generation,
    )
    .await;
}
