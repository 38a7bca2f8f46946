//! Tests that need the store's insides: a writer paused between its
//! publish and its commit (the zombie of a takeover race).

use std::sync::Mutex;

use tokio::sync::oneshot;

/// A pause armed by a test.
pub(crate) struct Pause {
    /// Told when the writer reached the pause.
    pub(crate) reached: oneshot::Sender<()>,
    /// Waited for before the writer goes on.
    pub(crate) resume: oneshot::Receiver<()>,
}

/// Points where a test can hold a writer.
#[derive(Default)]
pub(crate) struct Hooks {
    /// An append that published its events, before its record commit.
    pub(crate) before_commit: Mutex<Option<Pause>>,
}

impl Hooks {
    pub(crate) async fn before_commit(&self) {
        let pause = self
            .before_commit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(p) = pause {
            let _ = p.reached.send(());
            let _ = p.resume.await;
        }
    }
}
