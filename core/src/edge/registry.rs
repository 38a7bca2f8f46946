//! The Edge's registry of node connections: generations and readiness
//! (R-GEN-1..3).
//!
//! Every accepted connection of a node gets a generation strictly greater
//! than any generation handed out before, to any node, by this process or a
//! previous one (the driver seeds [`Registry::new`] with a floor it persisted
//! or derived from wall time, R-GEN-1). Only the current generation of a node,
//! and only once it completed readiness, is dispatchable (R-GEN-2). When a
//! connection ends, exactly its own generation is fenced (R-GEN-3); messages
//! later attributed to a fenced generation are ignored and counted.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use iop_wire::{CloseCode, PROTOCOL_VERSION, RegisterRequest, RejectReason};

use crate::ids::{Generation, NodeId};
#[cfg(feature = "planted-bugs")]
use crate::planted::{Planted, PlantedBug};
use crate::time::Instant;

/// The largest generation the registry hands out (R-GEN-1). Generations
/// stay within a signed 64-bit integer, so every consumer (logs, metrics,
/// status JSON) reads them exactly; a floor at or above this (a corrupted
/// state file) refuses every registration instead of wrapping around.
pub const GENERATION_LIMIT: Generation = i64::MAX as Generation;

/// A registration the Edge refuses.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rejection {
    /// Closed reason sent to the node.
    pub reason: RejectReason,
    /// Why, as the Edge sees it.
    pub cause: RejectCause,
    /// Detail for the node's log (no secrets).
    pub message: String,
}

/// Why a registration was refused, split by who is at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectCause {
    /// The node speaks another protocol version (the node's side).
    ProtocolVersionMismatch,
    /// The node id is not configured (the node's side).
    UnknownNode,
    /// No generation above the high-water mark is left below
    /// [`GENERATION_LIMIT`] (the Edge's side: its persisted generation
    /// state needs an operator). R-GEN-1 forbids reusing one.
    GenerationsExhausted,
    /// The new generation could not be made durable before use (the Edge's
    /// side: its state directory failed). R-GEN-1 across restarts needs it
    /// stored, so the connection is refused and its generation fenced.
    GenerationNotDurable,
}

impl RejectCause {
    /// The stable lower-case name (a closed label value).
    pub fn as_str(self) -> &'static str {
        match self {
            RejectCause::ProtocolVersionMismatch => "protocol_version_mismatch",
            RejectCause::UnknownNode => "unknown_node",
            RejectCause::GenerationsExhausted => "generations_exhausted",
            RejectCause::GenerationNotDurable => "generation_not_durable",
        }
    }
}

/// What the driver must do after a registry input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryOutput {
    /// Close this connection (a newer one of the same node replaced it).
    Close {
        /// Node.
        node: NodeId,
        /// The generation of the connection to close.
        generation: Generation,
        /// Why.
        code: CloseCode,
    },
    /// This generation is fenced: release its leases, end its runs with a
    /// transport terminal, mark its providers offline (R-GEN-3).
    Fenced {
        /// Node.
        node: NodeId,
        /// The fenced generation.
        generation: Generation,
        /// Why the connection ended.
        reason: CloseCode,
    },
    /// The node's current generation completed readiness: dispatchable.
    Ready {
        /// Node.
        node: NodeId,
        /// The ready generation.
        generation: Generation,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Current {
    generation: Generation,
    ready: bool,
    since: Instant,
}

#[derive(Debug, Default)]
struct NodeRecord {
    last_generation: Generation,
    current: Option<Current>,
}

/// A node's connection state, for the status surface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeConnectionView {
    /// Current generation, if connected.
    pub generation: Option<Generation>,
    /// Whether that generation completed readiness.
    pub ready: bool,
    /// When it connected.
    pub connected_since: Option<Instant>,
    /// The latest generation this node ever had.
    pub last_generation: Generation,
}

/// Node generations and readiness.
#[derive(Debug)]
pub struct Registry {
    nodes: BTreeMap<NodeId, NodeRecord>,
    known: Option<BTreeSet<NodeId>>,
    high_water: Generation,
    fenced_messages: u64,
    fences: u64,
    outputs: VecDeque<RegistryOutput>,
    #[cfg(feature = "planted-bugs")]
    planted: Planted,
}

impl Registry {
    /// A registry whose first generation is `generation_floor + 1`.
    ///
    /// The driver must pass a floor at least as large as every generation a
    /// previous process handed out (R-GEN-1 across restarts).
    pub fn new(generation_floor: Generation) -> Self {
        Self {
            nodes: BTreeMap::new(),
            known: None,
            high_water: generation_floor,
            fenced_messages: 0,
            fences: 0,
            outputs: VecDeque::new(),
            #[cfg(feature = "planted-bugs")]
            planted: Planted::default(),
        }
    }

    /// Switch a planted bug on (test-only; see [`crate::planted`]).
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&self, bug: PlantedBug) {
        self.planted.plant(bug);
    }

    /// Restrict registration to these node ids (`None`: any node with a
    /// valid certificate).
    pub fn set_known_nodes(&mut self, known: Option<BTreeSet<NodeId>>) {
        self.known = known;
    }

    /// The highest generation handed out; the driver persists it.
    pub fn high_water(&self) -> Generation {
        self.high_water
    }

    /// A node presented `request` on a new connection. On success returns
    /// the new generation; any previous connection of the node is fenced and
    /// closed as superseded.
    pub fn register(
        &mut self,
        now: Instant,
        node: &NodeId,
        request: &RegisterRequest,
    ) -> Result<Generation, Rejection> {
        if request.protocol_version != PROTOCOL_VERSION {
            return Err(Rejection {
                reason: RejectReason::ProtocolVersionMismatch,
                cause: RejectCause::ProtocolVersionMismatch,
                message: format!(
                    "node speaks protocol {}, edge speaks {}",
                    request.protocol_version, PROTOCOL_VERSION
                ),
            });
        }
        if let Some(known) = &self.known
            && !known.contains(node)
        {
            return Err(Rejection {
                reason: RejectReason::UnknownNode,
                cause: RejectCause::UnknownNode,
                message: "this node id is not configured on the edge".into(),
            });
        }
        // R-GEN-1: strictly greater than every generation ever handed out,
        // and never past the limit (no wrap-around to a reused generation).
        let Some(generation) = self
            .high_water
            .checked_add(1)
            .filter(|g| *g <= GENERATION_LIMIT)
        else {
            return Err(Rejection {
                // The wire has no closer reason: this Edge can take no new
                // connection until its generation state is repaired.
                reason: RejectReason::ShuttingDown,
                cause: RejectCause::GenerationsExhausted,
                message: "the edge has no generation left to hand out".into(),
            });
        };
        self.high_water = generation;
        let record = self.nodes.entry(node.clone()).or_default();
        debug_assert!(generation > record.last_generation);
        record.last_generation = generation;
        if let Some(old) = record.current.replace(Current {
            generation,
            ready: false,
            since: now,
        }) {
            self.fences += 1;
            self.outputs.push_back(RegistryOutput::Fenced {
                node: node.clone(),
                generation: old.generation,
                reason: CloseCode::Superseded,
            });
            self.outputs.push_back(RegistryOutput::Close {
                node: node.clone(),
                generation: old.generation,
                code: CloseCode::Superseded,
            });
        }
        Ok(generation)
    }

    /// The node reported readiness on `generation`. Returns whether it was
    /// accepted (only the current generation can become ready).
    pub fn ready(&mut self, _now: Instant, node: &NodeId, generation: Generation) -> bool {
        let Some(current) = self.current_mut(node) else {
            return false;
        };
        if current.generation != generation {
            return false;
        }
        if !current.ready {
            current.ready = true;
            self.outputs.push_back(RegistryOutput::Ready {
                node: node.clone(),
                generation,
            });
        }
        true
    }

    /// The connection of `generation` ended. Fences it if it is current;
    /// an already fenced generation is left alone (fenced exactly once).
    pub fn connection_closed(
        &mut self,
        _now: Instant,
        node: &NodeId,
        generation: Generation,
        reason: CloseCode,
    ) {
        #[cfg(feature = "planted-bugs")]
        if self.planted.has(PlantedBug::KeepLostConnection) && reason == CloseCode::HeartbeatTimeout
        {
            // Planted: a connection lost to liveness detection stays current.
            return;
        }
        let Some(record) = self.nodes.get_mut(node) else {
            return;
        };
        if record.current.map(|c| c.generation) == Some(generation) {
            record.current = None;
            self.fences += 1;
            self.outputs.push_back(RegistryOutput::Fenced {
                node: node.clone(),
                generation,
                reason,
            });
        }
    }

    /// Is `generation` the node's current generation?
    pub fn is_current(&self, node: &NodeId, generation: Generation) -> bool {
        #[cfg(feature = "planted-bugs")]
        if self.planted.has(PlantedBug::AcceptStaleGeneration) {
            // Planted: any generation the node ever had counts.
            return self
                .nodes
                .get(node)
                .is_some_and(|r| generation <= r.last_generation);
        }
        self.current(node).map(|c| c.generation) == Some(generation)
    }

    /// Is `generation` current *and* ready (R-GEN-2)?
    pub fn is_dispatchable(&self, node: &NodeId, generation: Generation) -> bool {
        self.current(node)
            .is_some_and(|c| c.generation == generation && c.ready)
    }

    /// The node's dispatchable generation, if any.
    pub fn dispatchable_generation(&self, node: &NodeId) -> Option<Generation> {
        self.current(node).filter(|c| c.ready).map(|c| c.generation)
    }

    /// A message arrived attributed to `generation`. Returns whether it may
    /// be processed; a message of a fenced generation is ignored and counted
    /// (R-GEN-3).
    pub fn admit_message(&mut self, node: &NodeId, generation: Generation) -> bool {
        if self.is_current(node, generation) {
            true
        } else {
            self.fenced_messages += 1;
            false
        }
    }

    /// Messages ignored because their generation was fenced.
    pub fn fenced_messages(&self) -> u64 {
        self.fenced_messages
    }

    /// Generations fenced so far.
    pub fn fences(&self) -> u64 {
        self.fences
    }

    /// Nodes with a current connection.
    pub fn connected_nodes(&self) -> usize {
        self.nodes.values().filter(|r| r.current.is_some()).count()
    }

    /// A node's connection state.
    pub fn view(&self, node: &NodeId) -> NodeConnectionView {
        let record = self.nodes.get(node);
        let current = record.and_then(|r| r.current);
        NodeConnectionView {
            generation: current.map(|c| c.generation),
            ready: current.is_some_and(|c| c.ready),
            connected_since: current.map(|c| c.since),
            last_generation: record.map_or(0, |r| r.last_generation),
        }
    }

    /// Next output, until `None`.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<RegistryOutput> {
        self.outputs.pop_front()
    }

    fn current(&self, node: &NodeId) -> Option<Current> {
        self.nodes.get(node).and_then(|r| r.current)
    }

    fn current_mut(&mut self, node: &NodeId) -> Option<&mut Current> {
        self.nodes.get_mut(node).and_then(|r| r.current.as_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> RegisterRequest {
        RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            node_version: "test".into(),
            providers: vec![],
            max_concurrent_runs: 4,
            recipient_public_key: None,
            parked: Vec::new(),
        }
    }

    fn drain(r: &mut Registry) -> Vec<RegistryOutput> {
        std::iter::from_fn(|| r.poll_output()).collect()
    }

    const T: Instant = Instant::ZERO;

    #[test]
    fn the_views_count_what_happened() {
        let mut r = Registry::new(0);
        let (a, b) = (NodeId::from("a"), NodeId::from("b"));
        assert_eq!((r.connected_nodes(), r.fenced_messages()), (0, 0));
        let ga = r.register(T, &a, &req()).unwrap();
        let gb = r.register(T, &b, &req()).unwrap();
        assert_eq!(r.connected_nodes(), 2);
        assert_eq!(r.dispatchable_generation(&a), None, "not before ready");
        assert!(r.ready(T, &a, ga));
        assert_eq!(r.dispatchable_generation(&a), Some(ga));
        r.connection_closed(T, &b, gb, CloseCode::Normal);
        assert_eq!(r.connected_nodes(), 1);
        assert!(!r.admit_message(&b, gb));
        assert!(!r.admit_message(&b, gb));
        assert!(r.admit_message(&a, ga));
        assert_eq!(r.fenced_messages(), 2, "each stale message counted once");
    }

    #[test]
    fn reject_causes_have_their_closed_labels() {
        for (cause, label) in [
            (
                RejectCause::ProtocolVersionMismatch,
                "protocol_version_mismatch",
            ),
            (RejectCause::UnknownNode, "unknown_node"),
            (RejectCause::GenerationsExhausted, "generations_exhausted"),
            (RejectCause::GenerationNotDurable, "generation_not_durable"),
        ] {
            assert_eq!(cause.as_str(), label);
        }
    }

    #[test]
    fn dispatch_is_refused_before_readiness() {
        let mut r = Registry::new(0);
        let a = NodeId::from("a");
        let g = r.register(T, &a, &req()).unwrap();
        assert!(r.is_current(&a, g));
        assert!(!r.is_dispatchable(&a, g), "R-GEN-2: not before ready");
        assert!(r.ready(T, &a, g));
        assert!(r.is_dispatchable(&a, g));
        assert_eq!(
            drain(&mut r),
            vec![RegistryOutput::Ready {
                node: a.clone(),
                generation: g
            }]
        );
    }

    #[test]
    fn generations_strictly_increase_per_node_and_across_restarts() {
        let mut r = Registry::new(0);
        let a = NodeId::from("a");
        let g1 = r.register(T, &a, &req()).unwrap();
        r.connection_closed(T, &a, g1, CloseCode::HeartbeatTimeout);
        let g2 = r.register(T, &a, &req()).unwrap();
        assert!(g2 > g1);
        // An edge restart seeded with the persisted high-water mark.
        let mut restarted = Registry::new(r.high_water());
        let g3 = restarted.register(T, &a, &req()).unwrap();
        assert!(g3 > g2, "R-GEN-1 across restarts");
    }

    #[test]
    fn closing_fences_only_its_own_generation_once() {
        let mut r = Registry::new(0);
        let a = NodeId::from("a");
        let g1 = r.register(T, &a, &req()).unwrap();
        let g2 = r.register(T, &a, &req()).unwrap();
        assert_eq!(
            drain(&mut r),
            vec![
                RegistryOutput::Fenced {
                    node: a.clone(),
                    generation: g1,
                    reason: CloseCode::Superseded
                },
                RegistryOutput::Close {
                    node: a.clone(),
                    generation: g1,
                    code: CloseCode::Superseded
                },
            ]
        );
        // The late close of the superseded connection fences nothing more.
        r.connection_closed(T, &a, g1, CloseCode::Normal);
        assert!(drain(&mut r).is_empty());
        assert!(r.is_current(&a, g2));
        r.connection_closed(T, &a, g2, CloseCode::Normal);
        assert_eq!(drain(&mut r).len(), 1);
        assert_eq!(r.fences(), 2);
    }

    #[test]
    fn late_messages_of_a_fenced_generation_are_ignored_and_counted() {
        let mut r = Registry::new(0);
        let a = NodeId::from("a");
        let g1 = r.register(T, &a, &req()).unwrap();
        let g2 = r.register(T, &a, &req()).unwrap();
        assert!(!r.admit_message(&a, g1));
        assert!(r.admit_message(&a, g2));
        assert!(
            !r.ready(T, &a, g1),
            "a stale generation cannot become ready"
        );
        assert_eq!(r.fenced_messages(), 1);
    }

    #[test]
    fn protocol_version_mismatch_is_rejected_with_a_reason() {
        let mut r = Registry::new(0);
        let mut bad = req();
        bad.protocol_version = PROTOCOL_VERSION + 1;
        let err = r.register(T, &NodeId::from("a"), &bad).unwrap_err();
        assert_eq!(err.reason, RejectReason::ProtocolVersionMismatch);
        assert_eq!(r.high_water(), 0, "no generation consumed");
    }

    #[test]
    fn registration_at_the_generation_limit_is_refused_without_wrapping() {
        let a = NodeId::from("a");
        let mut r = Registry::new(GENERATION_LIMIT - 1);
        assert_eq!(r.register(T, &a, &req()), Ok(GENERATION_LIMIT));
        for floor in [GENERATION_LIMIT, GENERATION_LIMIT + 1, Generation::MAX] {
            let mut r = Registry::new(floor);
            let err = r.register(T, &a, &req()).unwrap_err();
            assert_eq!(
                err.cause,
                RejectCause::GenerationsExhausted,
                "floor {floor}"
            );
            assert_eq!(err.reason, RejectReason::ShuttingDown);
            assert_eq!(r.high_water(), floor, "no generation consumed");
            assert_eq!(r.view(&a).generation, None, "nothing registered");
            assert!(drain(&mut r).is_empty(), "nothing fenced");
        }
        // The limit also holds for the next registration after the last one.
        let mut r = Registry::new(GENERATION_LIMIT - 1);
        let g = r.register(T, &a, &req()).unwrap();
        let err = r.register(T, &a, &req()).unwrap_err();
        assert_eq!(err.cause, RejectCause::GenerationsExhausted);
        assert_eq!(r.view(&a).generation, Some(g), "the current one stays");
    }

    #[test]
    fn unknown_node_is_rejected_when_nodes_are_configured() {
        let mut r = Registry::new(0);
        r.set_known_nodes(Some([NodeId::from("a")].into()));
        assert!(r.register(T, &NodeId::from("a"), &req()).is_ok());
        let err = r.register(T, &NodeId::from("b"), &req()).unwrap_err();
        assert_eq!(err.reason, RejectReason::UnknownNode);
    }
}
