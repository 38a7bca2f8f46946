//! One client request's record: its outcome, latency and relayed bytes in
//! the metrics, and its span, written once when the request ends.

use std::sync::Arc;

use axum::http::HeaderMap;

use crate::api::ApiError;
use crate::app_state::AppState;
use crate::in_flight::RequestView;
use crate::metrics::EdgeMetrics;
use crate::observe;
use crate::request_body::{BodyPermit, CLIENT_CLOSED_CODE};

/// Records one client request's outcome in the metrics when dropped; a
/// request dropped before an outcome was set was abandoned by its client.
pub(crate) struct RequestRecord {
    metrics: Arc<EdgeMetrics>,
    route: &'static str,
    started: std::time::Instant,
    outcome: &'static str,
    /// The request body's share of the budget (R-LIM-2).
    pub(crate) body_permit: Option<BodyPermit>,
    /// The request's span (`edge.request`), ended with the record.
    pub(crate) span: iop_transport::traces::TraceSpan,
    /// Response body bytes streamed to the client.
    pub(crate) relayed_bytes: u64,
    /// The view of the request's run, once it has one: its GenAI
    /// attributes and its `Server-Timing` come from it.
    pub(crate) view: Option<Arc<RequestView>>,
}

impl RequestRecord {
    /// The record of a request on `route`, started now.
    pub(crate) fn new(state: &AppState, route: &'static str, headers: &HeaderMap) -> Self {
        Self {
            metrics: state.metrics().clone(),
            route,
            started: std::time::Instant::now(),
            outcome: "client_disconnected",
            body_permit: None,
            span: observe::start_request(state.metrics(), route, headers),
            relayed_bytes: 0,
            view: None,
        }
    }

    /// A record that writes to `metrics` only, without a span.
    #[cfg(test)]
    pub(crate) fn unobserved(metrics: Arc<EdgeMetrics>, route: &'static str) -> Self {
        Self {
            metrics,
            route,
            started: std::time::Instant::now(),
            outcome: "client_disconnected",
            body_permit: None,
            span: iop_transport::traces::TraceSpan::none(),
            relayed_bytes: 0,
            view: None,
        }
    }

    /// The request ended with `outcome`.
    pub(crate) fn set(&mut self, outcome: &'static str) {
        self.outcome = outcome;
    }

    /// When the request arrived.
    pub(crate) fn started(&self) -> std::time::Instant {
        self.started
    }

    /// The request ended with `err`.
    pub(crate) fn error(&mut self, err: &ApiError) {
        self.outcome = outcome_of(err);
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.metrics
            .request(self.route, self.outcome, self.started.elapsed());
        self.metrics.relayed(self.route, self.relayed_bytes);
        if let Some(view) = &self.view {
            observe::genai_attributes(&self.metrics, &self.span, view);
        }
        observe::finish_request(&self.span, self.outcome, self.relayed_bytes);
    }
}

/// The closed outcome class of an error.
fn outcome_of(err: &ApiError) -> &'static str {
    if err.code == Some(CLIENT_CLOSED_CODE) {
        // The client went away mid-body: not a bad request (R-LIM-2).
        return "client_disconnected";
    }
    match err.status {
        400 | 408 | 413 | 422 => "invalid_request",
        401 | 403 => "unauthorized",
        404 => "not_found",
        429 => "rate_limited",
        502 => "provider_error",
        503 => "unavailable",
        504 => "timeout",
        _ => "internal",
    }
}
