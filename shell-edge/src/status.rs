//! The operator status surface: `GET /status` and `iop-edge status`.
//!
//! Shows per instance and per provider state, counters and times; never
//! account names, tokens, credentials, raw provider payloads or error text
//! (R-HT-6).

use serde_json::{Value, json};

use crate::config::EdgeConfig;
use crate::hub::HubSnapshot;

/// The `/status` document.
pub fn status_json(config: &EdgeConfig, snap: &HubSnapshot) -> Value {
    let providers: Vec<Value> = config
        .providers
        .iter()
        .map(|p| {
            let cap = snap
                .providers
                .iter()
                .find(|c| c.provider_id == p.spec.id);
            let node = snap.nodes.iter().find(|(n, ..)| *n == p.spec.node);
            let health = snap.health.iter().find(|h| h.provider_id == p.spec.id);
            json!({
                "id": p.spec.id.as_str(),
                "node": p.spec.node.as_str(),
                "adapter": p.spec.adapter.as_str(),
                "target": p.spec.target,
                "mode": match p.mode { crate::config::ProviderMode::Normalized => "normalized", crate::config::ProviderMode::Tunnel => "tunnel" },
                "node_connected": node.is_some_and(|(_, g, ..)| g.is_some()),
                "node_ready": node.is_some_and(|(_, _, ready, _)| *ready),
                "node_generation": node.and_then(|(_, g, ..)| *g),
                "leases_in_use": cap.map_or(0, |c| c.in_use),
                "capacity": p.spec.capacity,
                "runtime_eligible": cap.is_some_and(|c| c.runtime_eligible),
                "state": health.map_or("unknown", |h| h.state),
                "last_success_at": health.and_then(|h| h.last_success_at_ms),
                "consecutive_failures": health.map_or(0, |h| h.consecutive_failures),
                "failure_code": health.and_then(|h| h.failure_code),
                "next_retry_at": health.and_then(|h| h.next_retry_at_ms),
            })
        })
        .collect();
    json!({
        "instance": {
            "version": env!("CARGO_PKG_VERSION"),
            "nodes_connected": snap.nodes.iter().filter(|(_, g, ..)| g.is_some()).count(),
            "queue_depth": snap.queue_depth,
            "leases_in_use": snap.leases_in_use,
            "generation_fences": snap.fences,
            "fenced_late_messages": snap.fenced_messages,
            "connection_closes": snap.closes_by_reason,
            // The Edge's clock, so a reader shows times as ages without
            // trusting its own clock.
            "now_unix_ms": iop_transport::clock::unix_ms(),
        },
        "providers": providers,
    })
}

/// A moment as an age from `now_unix_ms`: "3 s ago", "in 12 s", "now";
/// seconds under two minutes, then minutes, hours and days.
pub fn age(now_unix_ms: u64, at_unix_ms: u64) -> String {
    let (delta_ms, future) = if at_unix_ms >= now_unix_ms {
        (at_unix_ms - now_unix_ms, true)
    } else {
        (now_unix_ms - at_unix_ms, false)
    };
    let secs = delta_ms / 1_000;
    let span = match secs {
        0 => return "now".to_owned(),
        1..120 => format!("{secs} s"),
        120..7_200 => format!("{} min", secs / 60),
        7_200..172_800 => format!("{} h", secs / 3_600),
        _ => format!("{} d", secs / 86_400),
    };
    if future {
        format!("in {span}")
    } else {
        format!("{span} ago")
    }
}

/// `/status` as a fixed-width table for `iop-edge status`; times are ages
/// from the Edge's `now_unix_ms` (or `local_now_unix_ms` when the document
/// has none).
pub fn status_table(doc: &Value, local_now_unix_ms: u64) -> String {
    let mut out = String::new();
    let i = &doc["instance"];
    let now = i["now_unix_ms"].as_u64().unwrap_or(local_now_unix_ms);
    let when = |v: &Value| v.as_u64().map_or_else(|| "-".to_owned(), |at| age(now, at));
    out.push_str(&format!(
        "iop-edge {}  nodes connected: {}  queue depth: {}  leases in use: {}  fences: {}  late messages: {}\n\n",
        i["version"].as_str().unwrap_or("?"),
        i["nodes_connected"],
        i["queue_depth"],
        i["leases_in_use"],
        i["generation_fences"],
        i["fenced_late_messages"],
    ));
    let header = [
        "PROVIDER",
        "NODE",
        "GEN",
        "STATE",
        "LEASES",
        "FAILURES",
        "FAILURE_CODE",
        "LAST_SUCCESS",
        "NEXT_RETRY",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for p in doc["providers"].as_array().into_iter().flatten() {
        let show = |v: &Value| match v {
            Value::Null => "-".to_owned(),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        rows.push(vec![
            show(&p["id"]),
            format!(
                "{}{}",
                show(&p["node"]),
                if p["node_ready"] == true {
                    ""
                } else {
                    " (down)"
                }
            ),
            show(&p["node_generation"]),
            show(&p["state"]),
            format!("{}/{}", p["leases_in_use"], p["capacity"]),
            show(&p["consecutive_failures"]),
            show(&p["failure_code"]),
            when(&p["last_success_at"]),
            when(&p["next_retry_at"]),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_shown_as_ages_not_epoch_milliseconds() {
        let now = 1_800_000_000_000;
        assert_eq!(age(now, now), "now");
        assert_eq!(age(now, now - 3_000), "3 s ago");
        assert_eq!(age(now, now + 12_400), "in 12 s");
        assert_eq!(age(now, now - 300_000), "5 min ago");
        assert_eq!(age(now, now - 3 * 3_600_000), "3 h ago");
        assert_eq!(age(now, now - 3 * 86_400_000), "3 d ago");

        let doc = json!({
            "instance": {"version": "x", "now_unix_ms": now},
            "providers": [{"id": "p", "node": "n", "node_ready": true, "capacity": 1,
                "leases_in_use": 0, "last_success_at": now - 3_000, "next_retry_at": null}],
        });
        let table = status_table(&doc, 0);
        assert!(table.contains("3 s ago"), "{table}");
        assert!(!table.contains(&(now - 3_000).to_string()), "{table}");
    }
}
