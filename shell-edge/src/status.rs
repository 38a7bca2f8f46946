//! The operator status surface: `GET /status` and `iop-edge status`.
//!
//! Shows per instance and per provider state, counters and times, the
//! journal store's health and the Edges sharing it (their ownership
//! leases, R-TAKE-1), each node's connection, the requests in flight, the
//! durable responses this Edge ran last and the configured limits of keys
//! and principals; never account names, tokens, credentials, raw provider
//! payloads or error text (R-HT-6).
//!
//! [`gather`] is the one place the document is put together: `/status`,
//! `iop-edge status` and the console ([`crate::console`]) all read it.

use std::time::Duration;

use serde_json::{Value, json};

use iop_core::edge::client_ids::log_tag;

use crate::app_state::AppState;
use crate::config::EdgeConfig;
use crate::durable::JournalStatus;
use crate::hub::{HubGone, HubSnapshot};

/// How long [`gather`] waits for the journal store's answers about the
/// recent durable responses; past it they are listed without their record.
pub const RECENT_RESPONSES_READ_MS: u64 = 500;

/// The whole `/status` document of the Edge `state` serves.
pub async fn gather(state: &AppState) -> Result<Value, HubGone> {
    let snap = state.hub().snapshot().await?;
    let mut doc = status_json(state.config(), &snap, &state.durable().status());
    doc["nodes"] = nodes_json(&snap);
    doc["requests"] = state.in_flight().status_json();
    doc["durable_responses"] = recent_responses_json(state).await;
    doc["limits"] = limits_json(state);
    // SPEC §9: the tenants' store, keys and today's totals per principal
    // (R-TEN-3, R-TEN-5).
    let mut tenants = state.tenancy().status(Duration::from_secs(1)).await;
    tenants["keys"] = state.keys().status();
    doc["tenants"] = tenants;
    let g = &state.metrics().gauges;
    let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    doc["instance"]["edge_id"] = json!(state.durable().edge_id());
    doc["instance"]["requests_finished"] = json!(count(&g.requests_finished));
    doc["instance"]["requests_ok"] = json!(count(&g.requests_ok));
    doc["instance"]["requests_in_flight"] = json!(state.in_flight().len());
    doc["instance"]["input_tokens"] = json!(count(&g.input_tokens));
    doc["instance"]["output_tokens"] = json!(count(&g.output_tokens));
    Ok(doc)
}

/// The `nodes` part: each node's connection (generation, age, readiness,
/// the QUIC path's round trip and loss, how its last connection ended).
fn nodes_json(snap: &HubSnapshot) -> Value {
    snap.connections
        .iter()
        .map(|c| {
            let loss_ratio = match (c.sent_packets, c.lost_packets) {
                (Some(sent), Some(lost)) if sent > 0 => Some(lost as f64 / sent as f64),
                _ => None,
            };
            json!({
                "node": c.node.as_str(),
                "connected": c.generation.is_some(),
                "ready": c.ready,
                "generation": c.generation,
                "last_generation": c.last_generation,
                "connected_since": c.connected_since_unix_ms,
                "rtt_ms": c.rtt_ms,
                "sent_packets": c.sent_packets,
                "lost_packets": c.lost_packets,
                "loss_ratio": loss_ratio,
                "last_close_reason": c.last_close.map(|(reason, _)| reason),
                "last_close_at": c.last_close.map(|(_, at)| at),
            })
        })
        .collect()
}

/// The `durable_responses` part: the responses this Edge ran last, each
/// by its log tag with its record's status, owner Edge and events, read from the store
/// (bounded by [`RECENT_RESPONSES_READ_MS`]).
async fn recent_responses_json(state: &AppState) -> Value {
    let durable = state.durable();
    let ids = durable.recent();
    let now = iop_transport::clock::unix_ms();
    let reads =
        futures::future::join_all(ids.iter().map(|id| durable.store().get(id.clone(), now)));
    let metas = tokio::time::timeout(Duration::from_millis(RECENT_RESPONSES_READ_MS), reads)
        .await
        .ok();
    let rows: Vec<Value> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let meta = metas
                .as_ref()
                .and_then(|m| m.get(i))
                .and_then(|r| r.as_ref().ok())
                .and_then(|r| r.as_ref())
                .map(|(meta, _)| meta);
            json!({
                // R-OBS-1: the tag logs name it by, never the id (an id
                // lets its principal fetch, cancel or continue it).
                "tag": log_tag(id),
                "live_here": durable.is_live(id),
                "status": meta.map(|m| m.status().as_str()),
                "owner": meta.map(|m| m.owner.as_str()),
                "events": meta.map(|m| m.last_seq),
                "api": meta.map(|m| m.api.as_str()),
                "background": meta.map(|m| m.background),
                "created_at": meta.map(|m| m.created_unix_ms),
                "reason": meta.and_then(|m| m.terminal.as_ref()).and_then(|t| t.reason.as_deref()),
            })
        })
        .collect();
    json!({ "edge_id": durable.edge_id(), "recent": rows })
}

/// The most keys the `limits` part lists (config keys first, then runtime
/// keys by id); the counts are always whole.
pub const MAX_LISTED_KEYS: usize = 200;

/// The `limits` part: each key (its id, never its secret) of the config
/// file and of the runtime keys (R-TEN-4, with whether it may be used now),
/// and each principal, with the limits and budgets configured for it.
fn limits_json(state: &AppState) -> Value {
    let config = state.config();
    let now = iop_transport::clock::unix_ms();
    let mut config_keys: Vec<&crate::config::ApiKey> = state.keys().config_keys().collect();
    config_keys.sort_by(|a, b| a.id.cmp(&b.id));
    let records = state.keys().records();
    let mut runtime: Vec<&iop_core::tenant::keys::KeyRecord> =
        records.values().map(|(r, _)| r.as_ref()).collect();
    runtime.sort_by(|a, b| a.id.cmp(&b.id));
    let total = config_keys.len() + runtime.len();
    let keys: Vec<Value> = config_keys
        .iter()
        .map(|k| {
            json!({
                "id": k.id,
                "principal": k.principal,
                "source": "config",
                "state": "usable",
                "admin": k.admin,
                "models": k.models,
                "limits": k.limits,
            })
        })
        .chain(runtime.iter().map(|r| {
            json!({
                "id": r.id,
                "principal": r.principal,
                "source": "runtime",
                "state": match r.usable(now) {
                    Ok(()) => "usable",
                    Err(iop_core::tenant::keys::KeyUnusable::Revoked) => "revoked",
                    Err(iop_core::tenant::keys::KeyUnusable::Expired) => "expired",
                },
                "admin": false,
                "models": r.models,
                "limits": r.limits,
            })
        }))
        .take(MAX_LISTED_KEYS)
        .collect();
    let principals: Vec<Value> = config
        .principals
        .iter()
        .map(|(name, limits)| json!({ "principal": name, "limits": limits }))
        .collect();
    json!({ "keys_total": total, "keys": keys, "principals": principals })
}

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
    let a = &j.availability;
    json!({
        "store": j.store,
        "edge_id": j.edge_id,
        // R-JRN-6: whether durable requests are served, and why not.
        "store_state": a.state,
        "store_state_since": a.since_unix_ms,
        "open_attempts": a.attempts,
        "last_open_failure": a.last_failure,
        "next_open_attempt_at": a.next_attempt_unix_ms,
        "quarantined_records": j.quarantined,
        "state": j.health.state(),
        "last_ok_at": j.health.last_ok_unix_ms,
        "last_error_at": j.health.last_error_unix_ms,
        "last_error": j.health.last_error,
        "errors": j.health.errors,
        "records": j.records,
        "bytes": j.bytes,
        "orphans_waiting": j.orphans_waiting,
        "durable_backlog": j.durable_backlog,
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
            let lowered = snap.overlay_lowered.contains(&p.spec.id);
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
                // R-OVL-2: stall evidence lowered its online generation.
                "overlay": if lowered { "lowered" } else { "clear" },
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
            "\njournal: {}  edge: {}  store: {}  state: {}  last ok: {}  last error: {} {}  errors: {}  records: {}  quarantined: {}  orphans waiting: {}  durable backlog: {}\n",
            show(&j["store"]),
            show(&j["edge_id"]),
            show(&j["store_state"]),
            show(&j["state"]),
            when(&j["last_ok_at"]),
            when(&j["last_error_at"]),
            show(&j["last_error"]),
            show(&j["errors"]),
            show(&j["records"]),
            show(&j["quarantined_records"]),
            show(&j["orphans_waiting"]),
            show(&j["durable_backlog"]),
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
            availability: crate::durable::StoreAvailability {
                state: "up",
                since_unix_ms: now - 10_000,
                ..Default::default()
            },
            quarantined: 2,
            health: crate::durable::StoreHealth {
                last_ok_unix_ms: Some(now - 2_000),
                last_error_unix_ms: Some(now - 60_000),
                last_error: Some("store_error"),
                errors: 3,
            },
            records: 7,
            bytes: 1024,
            orphans_waiting: 1,
            durable_backlog: false,
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
        assert_eq!(journal["store_state"], "up");
        assert_eq!(journal["quarantined_records"], 2);
        assert_eq!(journal["edges"][0]["this_edge"], true);
        assert_eq!(journal["edges"][2]["state"], "no_lease");
        let doc = json!({
            "instance": {"version": "x", "now_unix_ms": now},
            "providers": [],
            "journal": journal,
        });
        let table = status_table(&doc, 0);
        assert!(
            table.contains("journal: nats  edge: edge-a  store: up  state: ok  last ok: 2 s ago"),
            "{table}"
        );
        assert!(table.contains("quarantined: 2"), "{table}");
        assert!(table.contains("edge-a (this)  renewing"), "{table}");
        assert!(
            table.contains("edge-b         renewing  4 s ago"),
            "{table}"
        );
        assert!(table.contains("edge-c         no_lease"), "{table}");
    }
}
