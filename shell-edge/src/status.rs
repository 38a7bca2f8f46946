//! The operator status surface: `GET /status` and `iop-edge status`.
//!
//! Shows per instance and per provider state, counters and times, the
//! journal store's health and the Edges sharing it (their ownership
//! leases, R-TAKE-1); never account names, tokens, credentials, raw
//! provider payloads or error text (R-HT-6).

use serde_json::{Value, json};

use crate::config::EdgeConfig;
use crate::durable::JournalStatus;
use crate::hub::HubSnapshot;

/// The `journal` part of `/status`.
fn journal_json(j: &JournalStatus) -> Value {
    let edges: Vec<Value> = j
        .edges
        .iter()
        .map(|p| {
            json!({
                "edge_id": p.edge_id,
                "this_edge": p.edge_id == j.edge_id,
                "state": if p.lease.is_some() { p.state.as_str() } else { "no_lease" },
                "renewed_at": p.lease.as_ref().map(|l| l.renewed_unix_ms),
                "ttl_ms": p.lease.as_ref().map(|l| l.ttl_ms),
            })
        })
        .collect();
    json!({
        "store": j.store,
        "edge_id": j.edge_id,
        "state": j.health.state(),
        "last_ok_at": j.health.last_ok_unix_ms,
        "last_error_at": j.health.last_error_unix_ms,
        "last_error": j.health.last_error,
        "errors": j.health.errors,
        "records": j.records,
        "bytes": j.bytes,
        "orphans_waiting": j.orphans_waiting,
        "edges": edges,
    })
}

/// The `/status` document.
pub fn status_json(config: &EdgeConfig, snap: &HubSnapshot, journal: &JournalStatus) -> Value {
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
                // Effective: a node's reported limit where the config gives none.
                "capacity": cap.map_or(p.spec.capacity, |c| c.capacity),
                "runtime_eligible": cap.is_some_and(|c| c.runtime_eligible),
                "state": health.map_or("unknown", |h| h.state),
                "last_success_at": health.and_then(|h| h.last_success_at_ms),
                "consecutive_failures": health.map_or(0, |h| h.consecutive_failures),
                "failure_code": health.and_then(|h| h.failure_code),
                "next_retry_at": health.and_then(|h| h.next_retry_at_ms),
                "no_verdicts_total": health.map_or(0, |h| h.no_verdicts_total),
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
        "journal": journal_json(journal),
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
    table(&mut out, rows);
    let j = &doc["journal"];
    if j.is_object() {
        let show = |v: &Value| match v {
            Value::Null => "-".to_owned(),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        out.push_str(&format!(
            "\njournal: {}  edge: {}  state: {}  last ok: {}  last error: {} {}  errors: {}  records: {}  orphans waiting: {}\n",
            show(&j["store"]),
            show(&j["edge_id"]),
            show(&j["state"]),
            when(&j["last_ok_at"]),
            when(&j["last_error_at"]),
            show(&j["last_error"]),
            show(&j["errors"]),
            show(&j["records"]),
            show(&j["orphans_waiting"]),
        ));
        let mut edges = vec![
            ["EDGE", "LEASE", "RENEWED", "TTL_MS"]
                .map(str::to_owned)
                .to_vec(),
        ];
        for e in j["edges"].as_array().into_iter().flatten() {
            edges.push(vec![
                format!(
                    "{}{}",
                    show(&e["edge_id"]),
                    if e["this_edge"] == true {
                        " (this)"
                    } else {
                        ""
                    }
                ),
                show(&e["state"]),
                when(&e["renewed_at"]),
                show(&e["ttl_ms"]),
            ]);
        }
        if edges.len() > 1 {
            out.push('\n');
            table(&mut out, edges);
        }
    }
    out
}

/// Rows as left-aligned columns two spaces apart.
fn table(out: &mut String, rows: Vec<Vec<String>>) {
    let columns = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
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

    #[test]
    fn the_journal_shows_its_store_health_and_the_edges_sharing_it() {
        use iop_core::journal::{EdgeLease, LeaseState, PeerLease};
        let now = 1_800_000_000_000;
        let status = JournalStatus {
            store: "nats",
            edge_id: "edge-a".into(),
            health: crate::durable::StoreHealth {
                last_ok_unix_ms: Some(now - 2_000),
                last_error_unix_ms: Some(now - 60_000),
                last_error: Some("store_error"),
                errors: 3,
            },
            records: 7,
            bytes: 1024,
            orphans_waiting: 1,
            edges: ["edge-a", "edge-b"]
                .into_iter()
                .map(|id| PeerLease {
                    edge_id: id.into(),
                    state: LeaseState::Renewing,
                    lease: Some(EdgeLease {
                        edge_id: id.into(),
                        incarnation: 1,
                        ttl_ms: 15_000,
                        renewed_unix_ms: now - 4_000,
                    }),
                })
                .chain(std::iter::once(PeerLease {
                    edge_id: "edge-c".into(),
                    state: LeaseState::Expired,
                    lease: None,
                }))
                .collect(),
        };
        let journal = journal_json(&status);
        assert_eq!(journal["state"], "ok");
        assert_eq!(journal["edges"][0]["this_edge"], true);
        assert_eq!(journal["edges"][2]["state"], "no_lease");
        let doc = json!({
            "instance": {"version": "x", "now_unix_ms": now},
            "providers": [],
            "journal": journal,
        });
        let table = status_table(&doc, 0);
        assert!(
            table.contains("journal: nats  edge: edge-a  state: ok  last ok: 2 s ago"),
            "{table}"
        );
        assert!(table.contains("edge-a (this)  renewing"), "{table}");
        assert!(
            table.contains("edge-b         renewing  4 s ago"),
            "{table}"
        );
        assert!(table.contains("edge-c         no_lease"), "{table}");
    }
}
