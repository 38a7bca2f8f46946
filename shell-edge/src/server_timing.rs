//! The `Server-Timing` header (W3C Server Timing) of every answer of the
//! run endpoints: how much of the time a client waited was iop's own.
//!
//! * `queue`: waiting for a capacity lease, over every attempt;
//! * `provider`: in attempts on providers (from the attempt's start, which
//!   includes the Node's hop, to its end), over every attempt;
//! * `edge`: the rest (authentication, reading and parsing the body,
//!   admission, the pre-send fence, building the answer);
//! * `total`: from the request's arrival to the moment the header was
//!   written.
//!
//! Headers go out before a streamed body: a streamed answer's header can
//! only tell what is known then. Its `provider` is marked
//! `desc="to first content"` and its `total` is the time to the headers
//! (time to first byte), `desc="to headers"`; the rest of the stream is not
//! in it. A whole (non-streamed) answer's header covers the whole request.
//! Durations are milliseconds with one decimal, as the header's `dur`
//! expects.

use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue};

use crate::in_flight::RequestView;

/// The header's name.
pub const SERVER_TIMING: &str = "server-timing";

/// The header value for a request that started at `started`, whose run's
/// view is `view` (none: no run was started), read at `now`.
pub fn value(started: Instant, view: Option<&RequestView>, now: Instant) -> String {
    let total = now.saturating_duration_since(started);
    let (queued, provider, streamed) = match view {
        Some(view) => {
            let read = view.read_at(now);
            (read.queued, read.provider, view.streamed())
        }
        None => (Duration::ZERO, Duration::ZERO, false),
    };
    let edge = total.saturating_sub(queued).saturating_sub(provider);
    let (provider_desc, total_desc) = if streamed {
        ("desc=\"to first content\";", "desc=\"to headers\";")
    } else {
        ("", "")
    };
    // One string, integers only, no formatting machinery: this header is
    // on every answer, and `write!` of its eight numbers cost more than
    // the rest of it.
    let mut out = String::with_capacity(128);
    out.push_str("queue;dur=");
    push_ms(&mut out, queued);
    out.push_str(", provider;");
    out.push_str(provider_desc);
    out.push_str("dur=");
    push_ms(&mut out, provider);
    out.push_str(", edge;dur=");
    push_ms(&mut out, edge);
    out.push_str(", total;");
    out.push_str(total_desc);
    out.push_str("dur=");
    push_ms(&mut out, total);
    out
}

/// Add the header to `headers`, computed now.
pub fn apply(started: Instant, view: Option<&RequestView>, headers: &mut HeaderMap) {
    if let Ok(v) = HeaderValue::try_from(value(started, view, Instant::now())) {
        headers.insert(SERVER_TIMING, v);
    }
}

/// A duration as milliseconds with one decimal, rounded half up.
fn push_ms(out: &mut String, d: Duration) {
    let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    let tenths = micros.saturating_add(50) / 100;
    let mut digits = itoa::Buffer::new();
    out.push_str(digits.format(tenths / 10));
    out.push('.');
    out.push(char::from(b'0' + (tenths % 10) as u8));
}

#[cfg(test)]
mod tests {
    use iop_core::ids::ProviderId;

    use super::*;

    /// `name -> dur` of a header value.
    fn durations(value: &str) -> Vec<(String, f64)> {
        value
            .split(", ")
            .map(|metric| {
                let name = metric.split(';').next().unwrap_or_default().to_owned();
                let dur = metric
                    .split(';')
                    .find_map(|p| p.strip_prefix("dur="))
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(f64::NAN);
                (name, dur)
            })
            .collect()
    }

    #[test]
    fn durations_are_milliseconds_with_one_decimal_rounded_half_up() {
        let show = |d| {
            let mut out = String::new();
            push_ms(&mut out, d);
            out
        };
        let ms = |micros| show(Duration::from_micros(micros));
        assert_eq!(ms(0), "0.0");
        assert_eq!(ms(49), "0.0");
        assert_eq!(ms(50), "0.1");
        assert_eq!(ms(1_049), "1.0");
        assert_eq!(ms(1_050), "1.1");
        assert_eq!(ms(123_456), "123.5");
        assert_eq!(ms(2_000_000), "2000.0");
        assert_eq!(ms(9_999_949), "9999.9");
        assert_eq!(ms(9_999_950), "10000.0");
        assert_eq!(show(Duration::MAX), "18446744073709551.6");
    }

    #[test]
    fn the_parts_add_up_to_the_total_and_edge_is_what_is_left() {
        let view = RequestView::new("chat", "m", false);
        view.queue_started();
        view.queue_ended();
        view.attempt_started(&ProviderId::new("p1"), 1);
        let now = view.started() + Duration::from_millis(500);
        let value = value(view.started(), Some(&view), now);
        let d = durations(&value);
        let names: Vec<&str> = d.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["queue", "provider", "edge", "total"], "{value}");
        assert_eq!(d[3].1, 500.0, "{value}");
        let sum = d[0].1 + d[1].1 + d[2].1;
        assert!((sum - 500.0).abs() <= 0.3, "{value}");
        assert!(d[1].1 > 400.0, "the attempt in flight counts: {value}");
        assert!(HeaderValue::try_from(value).is_ok());
    }

    #[test]
    fn a_streamed_answer_says_its_header_covers_the_time_to_headers() {
        let view = RequestView::new("chat", "m", true);
        let value = value(view.started(), Some(&view), view.started());
        assert!(value.contains("total;desc=\"to headers\""), "{value}");
        assert!(
            value.contains("provider;desc=\"to first content\""),
            "{value}"
        );
    }

    #[test]
    fn a_request_refused_before_its_run_spent_all_its_time_in_the_edge() {
        let started = Instant::now();
        let value = value(started, None, started + Duration::from_millis(3));
        assert_eq!(
            value,
            "queue;dur=0.0, provider;dur=0.0, edge;dur=3.0, total;dur=3.0"
        );
    }
}
