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
        },
        "providers": providers,
    })
}

/// `/status` as a fixed-width table for `iop-edge status`.
pub fn status_table(doc: &Value) -> String {
    let mut out = String::new();
    let i = &doc["instance"];
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
        "LAST_SUCCESS_MS",
        "NEXT_RETRY_MS",
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
            show(&p["last_success_at"]),
            show(&p["next_retry_at"]),
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
