//! The web console: a page at `/console` that shows the Edge live.
//!
//! The page, its script and its style are compiled into the binary
//! (`include_str!`); nothing is fetched from elsewhere. What it shows is the
//! `/status` document ([`crate::status::gather`]), pushed every
//! [`PUSH_INTERVAL_MS`] over a server-sent event stream.
//!
//! ## Signing in
//!
//! A browser cannot send a bearer header when it navigates, and an
//! `EventSource` sends none, so the page asks for an admin key and posts it
//! once to `POST /console/session`. The Edge answers with a session cookie:
//! a random token (never the key), `HttpOnly` (the page's script cannot
//! read it), `SameSite=Strict` (no other site's page sends it), scoped to
//! `/console` and valid for [`SESSION_TTL_MS`]. The Edge keeps only the
//! token's SHA-256, at most [`MAX_SESSIONS`] of them (the oldest goes
//! first). `DELETE /console/session` signs out. No secret is ever in a URL
//! or a log line.
//!
//! The data endpoints (`GET /console/status`, `GET /console/events`) take
//! the session cookie or, for scripts, `Authorization: Bearer` with an
//! admin key. A request that names an `Origin` other than the Edge's own
//! host is refused. At most [`MAX_STREAMS`] event streams are open at once
//! (past it: 429), and they share one document gathered at most every
//! [`crate::console_sessions::STATUS_REUSE_MS`]; a stream ends when its
//! session expires and when the Edge shuts down.

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::sync::OwnedSemaphorePermit;

use crate::api::ApiError;
use crate::app_state::{AppState, admin_key, authenticate_admin};
pub use crate::console_sessions::{MAX_SESSIONS, MAX_STREAMS, SESSION_TTL_MS};

/// How often a stream pushes a fresh status document.
pub const PUSH_INTERVAL_MS: u64 = 1_000;

/// The largest sign-in body read.
pub const MAX_SIGN_IN_BYTES: usize = 4 * 1024;

/// How long the sign-in body may take to arrive.
const SIGN_IN_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The session cookie's name.
pub const COOKIE: &str = "iop_console";

const PAGE: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// The page's policy: its own script and style only, no frames, no
/// connection but to the Edge.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The console's routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/console", get(page))
        .route("/console/", get(page))
        .route("/console/console.js", get(script))
        .route("/console/console.css", get(style))
        .route(
            "/console/session",
            axum::routing::post(sign_in).delete(sign_out),
        )
        .route("/console/status", get(status))
        .route("/console/events", get(events))
}

/// Headers every console answer carries: nothing cached, nothing sniffed,
/// no referrer, never framed.
fn guarded(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    guarded(([(header::CONTENT_TYPE, content_type)], body).into_response())
}

async fn page() -> Response {
    let mut response = asset("text/html; charset=utf-8", PAGE);
    response.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    response
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

/// The session token in a `Cookie` header, if any.
fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then_some(value.trim())
        })
        .filter(|v| !v.is_empty())
}

/// Refuse a request whose `Origin` is not the Edge's own host (a page of
/// another site); a request without one (a script, a same-origin `GET`)
/// passes.
fn same_origin(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return Ok(());
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, rest)| rest.trim_end_matches('/'));
    match (origin_host, host) {
        (Some(o), Some(h)) if o.eq_ignore_ascii_case(h) => Ok(()),
        _ => Err(ApiError::permission_denied()),
    }
}

/// Who reads the console: an admin key's bearer header, else a live
/// session's cookie.
fn reader(state: &AppState, headers: &HeaderMap) -> Result<String, ApiError> {
    same_origin(headers)?;
    if headers.contains_key(header::AUTHORIZATION) {
        return authenticate_admin(state, headers).map(|k| k.principal.clone());
    }
    let token = session_cookie(headers).ok_or_else(ApiError::missing_api_key)?;
    state
        .console()
        .session(token, Instant::now())
        .ok_or_else(ApiError::invalid_api_key)
}

/// The sign-in body: `{"key": "..."}`.
#[derive(serde::Deserialize)]
struct SignIn {
    key: String,
}

/// `POST /console/session`: an admin key in, a session cookie out.
async fn sign_in(State(state): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let answer: Result<String, ApiError> = async {
        same_origin(&parts.headers)?;
        let bytes = tokio::time::timeout(
            SIGN_IN_READ_TIMEOUT,
            axum::body::to_bytes(body, MAX_SIGN_IN_BYTES),
        )
        .await
        .map_err(|_| ApiError::malformed_json("the body did not arrive in time"))?
        .map_err(|_| ApiError::body_too_large(MAX_SIGN_IN_BYTES))?;
        let sign_in: SignIn =
            serde_json::from_slice(&bytes).map_err(|e| ApiError::from_json_error(&e))?;
        let key = admin_key(&state, &sign_in.key)?;
        Ok(key.principal.clone())
    }
    .await;
    match answer {
        Ok(principal) => {
            let token = state.console().open_session(&principal, Instant::now());
            tracing::info!(event = "edge_console_signed_in", principal = %principal);
            let secure = parts
                .headers
                .get("x-forwarded-proto")
                .is_some_and(|p| p.as_bytes().eq_ignore_ascii_case(b"https"));
            let cookie = format!(
                "{COOKIE}={token}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={}{}",
                SESSION_TTL_MS / 1_000,
                if secure { "; Secure" } else { "" }
            );
            let mut response = guarded(
                axum::Json(serde_json::json!({
                    "principal": principal,
                    "expires_in_s": SESSION_TTL_MS / 1_000,
                }))
                .into_response(),
            );
            if let Ok(v) = HeaderValue::try_from(cookie) {
                response.headers_mut().insert(header::SET_COOKIE, v);
            }
            response
        }
        Err(e) => {
            tracing::warn!(
                event = "edge_console_sign_in_refused",
                reason = e.code.unwrap_or("invalid")
            );
            guarded(e.into_response())
        }
    }
}

/// `DELETE /console/session`: forget the session; the cookie is cleared.
async fn sign_out(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = same_origin(&headers) {
        return guarded(e.into_response());
    }
    if let Some(token) = session_cookie(&headers) {
        state.console().close_session(token);
    }
    let mut response = guarded(StatusCode::NO_CONTENT.into_response());
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static(
            "iop_console=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0",
        ),
    );
    response
}

/// `GET /console/status`: the status document once.
async fn status(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = reader(&state, &headers) {
        return guarded(e.into_response());
    }
    match crate::status::gather(&state).await {
        Ok(doc) => guarded(axum::Json(doc).into_response()),
        Err(_) => guarded(ApiError::internal().into_response()),
    }
}

/// The status document as text: the one another stream gathered moments
/// ago, or a fresh one (`None`: the Edge is stopping).
async fn status_text(state: &AppState) -> Option<std::sync::Arc<str>> {
    let console = state.console();
    if let Some(doc) = console.fresh_status(Instant::now()) {
        return Some(doc);
    }
    let doc: std::sync::Arc<str> = crate::status::gather(state).await.ok()?.to_string().into();
    console.keep_status(doc.clone(), Instant::now());
    Some(doc)
}

/// What a console stream holds between pushes.
struct Stream {
    state: AppState,
    /// The session it reads under (`None`: a bearer header).
    session: Option<String>,
    ticks: tokio::time::Interval,
    closing: tokio::sync::watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
    ended: bool,
}

/// `GET /console/events`: the status document every
/// [`PUSH_INTERVAL_MS`] as `status` events, until the session expires
/// (an `expired` event) or the Edge shuts down.
async fn events(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = reader(&state, &headers) {
        return guarded(e.into_response());
    }
    let Some(permit) = state.console().try_open_stream() else {
        return guarded(ApiError::console_streams_full(MAX_STREAMS).into_response());
    };
    let session = if headers.contains_key(header::AUTHORIZATION) {
        None
    } else {
        session_cookie(&headers).map(str::to_owned)
    };
    let mut ticks = tokio::time::interval(Duration::from_millis(PUSH_INTERVAL_MS));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let stream = Stream {
        closing: state.console().closing(),
        state,
        session,
        ticks,
        _permit: permit,
        ended: false,
    };
    let events = futures::stream::unfold(stream, |mut s| async move {
        if s.ended {
            return None;
        }
        tokio::select! {
            _ = s.ticks.tick() => {}
            _ = s.closing.wait_for(|c| *c) => return None,
        }
        let expired = s
            .session
            .as_deref()
            .is_some_and(|t| s.state.console().session(t, Instant::now()).is_none());
        let event = if expired {
            s.ended = true;
            Event::default().event("expired").data("{}")
        } else {
            match status_text(&s.state).await {
                Some(doc) => Event::default().event("status").data(&*doc),
                // The hub is gone: the Edge is stopping.
                None => return None,
            }
        };
        Some((Ok::<_, std::convert::Infallible>(event), s))
    });
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response();
    // Proxies must not buffer the stream.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    guarded(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut h = HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; iop_console=t0k; b=2"),
        );
        assert_eq!(session_cookie(&h), Some("t0k"));
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, HeaderValue::from_static("iop_console="));
        assert_eq!(session_cookie(&h), None, "an empty cookie is no session");
    }

    #[test]
    fn a_page_of_another_site_is_refused() {
        let with = |origin: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::HOST, HeaderValue::from_static("edge:8080"));
            h.insert(header::ORIGIN, HeaderValue::from_static(origin));
            same_origin(&h)
        };
        assert!(with("http://edge:8080").is_ok());
        assert!(with("https://EDGE:8080").is_ok());
        assert!(with("http://evil.example").is_err());
        assert!(with("null").is_err());
        assert!(
            same_origin(&HeaderMap::new()).is_ok(),
            "no origin: a script"
        );
    }
}
