//! The console's sign-in sessions and live streams: who signed in (by a
//! random token's digest, never the key), until when, and how many event
//! streams are open. [`crate::console`] serves the routes that use them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a console session lasts after sign-in.
pub const SESSION_TTL_MS: u64 = 60 * 60 * 1_000;

/// The most console sessions kept at once; a new one past it replaces the
/// oldest.
pub const MAX_SESSIONS: usize = 64;

/// The most console event streams open at once.
pub const MAX_STREAMS: usize = 8;

/// How long a gathered status document is pushed to every stream again
/// before it is gathered anew: the streams together ask the Edge about
/// twice a second, however many are open.
pub const STATUS_REUSE_MS: u64 = 500;

/// One signed-in session.
#[derive(Debug, Clone)]
struct Session {
    principal: String,
    expires: Instant,
}

/// The console's sessions and live streams (one per Edge).
#[derive(Debug)]
pub struct ConsoleSessions {
    /// SHA-256 of each session token -> the session.
    sessions: Mutex<HashMap<[u8; 32], Session>>,
    streams: Arc<Semaphore>,
    closing: tokio::sync::watch::Sender<bool>,
    /// The last status document pushed, and when it was gathered.
    status: Mutex<Option<(Instant, Arc<str>)>>,
}

impl ConsoleSessions {
    /// No sessions, no streams.
    pub fn new() -> Arc<Self> {
        Arc::new(ConsoleSessions {
            sessions: Mutex::new(HashMap::new()),
            streams: Arc::new(Semaphore::new(MAX_STREAMS)),
            closing: tokio::sync::watch::channel(false).0,
            status: Mutex::new(None),
        })
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<[u8; 32], Session>> {
        // Entries are inserted and removed whole.
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new session of `principal`: its token.
    pub fn open_session(&self, principal: &str, now: Instant) -> String {
        let token: [u8; 32] = rand::random();
        let token = hex(&token);
        let mut sessions = self.sessions();
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| *k)
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            digest(&token),
            Session {
                principal: principal.to_owned(),
                expires: now + Duration::from_millis(SESSION_TTL_MS),
            },
        );
        token
    }

    /// The principal of a live session `token`.
    pub fn session(&self, token: &str, now: Instant) -> Option<String> {
        let sessions = self.sessions();
        sessions
            .get(&digest(token))
            .filter(|s| s.expires > now)
            .map(|s| s.principal.clone())
    }

    pub fn close_session(&self, token: &str) {
        self.sessions().remove(&digest(token));
    }

    /// Sessions kept now.
    pub fn session_count(&self) -> usize {
        self.sessions().len()
    }

    /// A place for one more event stream, held until the permit is
    /// dropped; `None` when all [`MAX_STREAMS`] are taken.
    pub fn try_open_stream(&self) -> Option<OwnedSemaphorePermit> {
        self.streams.clone().try_acquire_owned().ok()
    }

    /// Changes to `true` when every stream must end.
    pub fn closing(&self) -> tokio::sync::watch::Receiver<bool> {
        self.closing.subscribe()
    }

    /// The status document gathered less than [`STATUS_REUSE_MS`] before
    /// `now`, if there is one.
    pub fn fresh_status(&self, now: Instant) -> Option<Arc<str>> {
        let status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status
            .as_ref()
            .filter(|(at, _)| {
                now.saturating_duration_since(*at) < Duration::from_millis(STATUS_REUSE_MS)
            })
            .map(|(_, doc)| doc.clone())
    }

    /// Keep `doc`, gathered at `at`, for the other streams.
    pub fn keep_status(&self, doc: Arc<str>, at: Instant) {
        *self.status.lock().unwrap_or_else(|e| e.into_inner()) = Some((at, doc));
    }

    /// End every event stream (the Edge shuts down): a stream must not
    /// hold the HTTP server's drain.
    pub fn close_streams(&self) {
        self.closing.send_replace(true);
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_lasts_its_ttl_and_the_oldest_goes_past_the_bound() {
        let console = ConsoleSessions::new();
        let t0 = Instant::now();
        let first = console.open_session("ops", t0);
        assert_eq!(console.session(&first, t0).as_deref(), Some("ops"));
        assert_eq!(
            console.session(&first, t0 + Duration::from_millis(SESSION_TTL_MS)),
            None,
            "expired at its TTL"
        );
        for i in 1..MAX_SESSIONS {
            console.open_session("ops", t0 + Duration::from_millis(i as u64));
        }
        assert_eq!(console.session_count(), MAX_SESSIONS);
        let newest = console.open_session("ops", t0 + Duration::from_secs(1));
        assert_eq!(console.session_count(), MAX_SESSIONS, "bounded");
        assert_eq!(
            console.session(&first, t0),
            None,
            "the oldest session made room"
        );
        assert!(console.session(&newest, t0).is_some());
        assert!(console.session("not-a-token", t0).is_none());
    }

    #[test]
    fn a_status_document_is_reused_for_half_a_push_interval() {
        let console = ConsoleSessions::new();
        let t0 = Instant::now();
        assert!(console.fresh_status(t0).is_none());
        console.keep_status("{}".into(), t0);
        let reuse = Duration::from_millis(STATUS_REUSE_MS);
        assert!(console.fresh_status(t0 + reuse / 2).is_some());
        assert!(console.fresh_status(t0 + reuse).is_none(), "gathered anew");
    }
}
