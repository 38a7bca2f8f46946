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
