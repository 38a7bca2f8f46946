//! The simulated network between the Edge and its nodes, after str0m's
//! `netem`: sans-IO and seeded, it only computes *when* (and whether) a
//! message arrives; the world's event queue carries it.
//!
//! * **Latency and jitter** per node link: one-way delay
//!   `latency_min + uniform(0..=jitter_max)`.
//! * **Streams**: messages on one stream (the control stream, one run's
//!   stream, one command's stream) arrive in the order they were sent;
//!   different streams interleave freely (jitter reorders them).
//! * **Loss that kills a connection**: QUIC retransmits, so a lost packet
//!   either heals or, past the idle timeout, ends the connection. The model
//!   keeps only the second case: a message may kill its connection; each
//!   side is told (after a short delay) or finds out through its heartbeat.
//! * **Heartbeat loss**: a ping or pong may vanish on its own, without
//!   killing the connection (the peer's wait then expires).
//! * **Partitions**, symmetric or one-way per node link: traffic in a blocked
//!   direction is held (retransmitted) until the partition heals; a
//!   connection-close frame sent into a partition is lost.
//! * **Dials** fail (after the connect timeout) while the Edge is down or the
//!   link is partitioned either way.

use std::collections::BTreeMap;
use std::time::Duration;

use iop_core::Instant;
use iop_core::ids::RunId;
use iop_wire::{CloseCode, CommandResult, DataRequest, EdgeControl, NodeControl, RunEvent};
use serde::Serialize;

use crate::config::{Rng, SimConfig};

/// A simulated QUIC connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ConnId(pub u64);

/// Which way a message travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Dir {
    /// Edge to node.
    EdgeToNode,
    /// Node to Edge.
    NodeToEdge,
}

impl Dir {
    fn index(self) -> usize {
        match self {
            Dir::EdgeToNode => 0,
            Dir::NodeToEdge => 1,
        }
    }
}

/// Which stream of a connection a message rides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum StreamKey {
    /// The control stream (registration, readiness, heartbeats, cancels).
    Control,
    /// One run's bidirectional stream.
    Run(RunId),
    /// One command's stream.
    Command(u64),
    /// The connection-close frame (not a stream; never held).
    Close,
}

/// What travels: real `iop_wire` messages in a sim envelope.
// The envelope holds the wire messages by value, as the shells do; a run
// request's optional fields make its variant the largest.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Payload {
    /// Node to Edge, control stream.
    NodeControl(NodeControl),
    /// Edge to Node, control stream.
    EdgeControl(EdgeControl),
    /// Edge to Node, opening a data stream.
    Data(DataRequest),
    /// Node to Edge, on a run's stream.
    RunEvent(RunEvent),
    /// Node to Edge, on a command's stream.
    CommandResult(CommandResult),
    /// The connection-close frame with its code.
    Close(CloseCode),
    /// Edge to Node, on a durable run's stream: every frame through
    /// `through_frame` is durable (`RunStreamFrame::Ack`, R-PARK-1).
    RunAck {
        /// The run on this connection.
        run_id: u64,
        /// The last durable frame.
        through_frame: u64,
    },
    /// Node to Edge: the run's stream was reset (an adoption the node
    /// refused, R-PARK-2); the Edge reads the stream's end.
    RunReset {
        /// The run on this connection.
        run_id: u64,
    },
}

impl Payload {
    /// Whether this is a heartbeat ping or pong (subject to heartbeat loss).
    pub fn is_heartbeat(&self) -> bool {
        matches!(
            self,
            Payload::NodeControl(NodeControl::Ping(_) | NodeControl::Pong(_))
                | Payload::EdgeControl(EdgeControl::Ping(_) | EdgeControl::Pong(_))
        )
    }
}

/// A message in flight.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Envelope {
    /// Connection.
    pub conn: ConnId,
    /// Direction.
    pub dir: Dir,
    /// Stream.
    pub stream: StreamKey,
    /// The message.
    pub payload: Payload,
}

/// What became of a sent message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOutcome {
    /// It arrives at this moment.
    Deliver(Instant),
    /// It was lost; the connection lives on.
    Lost,
    /// The connection is already dead.
    Dead,
    /// Sending it killed the connection.
    Killed,
}

/// Which partition a link is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionKind {
    /// Both directions blocked.
    Symmetric,
    /// Only Edge to node blocked.
    EdgeToNode,
    /// Only node to Edge blocked.
    NodeToEdge,
}

#[derive(Debug, Clone, Copy)]
struct ConnState {
    node: usize,
    edge_incarnation: u64,
    alive: bool,
}

/// Fault rates the network applies while faults are on.
#[derive(Debug, Clone, Copy, Default)]
pub struct NetFaults {
    /// Per message: kill the connection.
    pub conn_kill_ppm: u32,
    /// Per heartbeat message: lose it.
    pub heartbeat_loss_ppm: u32,
    /// Per message (close frames aside): a packet of it is lost and
    /// retransmitted, so it (and its stream behind it) arrives up to
    /// `retransmit_max` late while other streams go on.
    pub retransmit_ppm: u32,
    /// The longest retransmission delay.
    pub retransmit_max: Duration,
}

/// The network model.
#[derive(Debug)]
pub struct Network {
    latency_min: Vec<Duration>,
    jitter_max: Vec<Duration>,
    /// Per node, per direction: blocked until this moment.
    blocked_until: Vec<[Instant; 2]>,
    conns: BTreeMap<ConnId, ConnState>,
    /// Per (connection, direction, stream): the latest arrival scheduled,
    /// so a stream stays FIFO. Bounded: entries of dead connections are
    /// dropped when the connection dies.
    last_arrival: BTreeMap<(ConnId, Dir, StreamKey), Instant>,
    next_conn: u64,
    faults: NetFaults,
    /// Messages lost to heartbeat loss or partitions.
    pub lost: u64,
    /// Connections killed by loss.
    pub killed: u64,
    /// Messages delayed by a retransmission.
    pub retransmitted: u64,
}

impl Network {
    /// The network of a world.
    pub fn new(config: &SimConfig) -> Self {
        Self {
            latency_min: config.latency_min.clone(),
            jitter_max: config.jitter_max.clone(),
            blocked_until: vec![[Instant::ZERO; 2]; config.nodes],
            conns: BTreeMap::new(),
            last_arrival: BTreeMap::new(),
            next_conn: 1,
            faults: NetFaults::default(),
            lost: 0,
            killed: 0,
            retransmitted: 0,
        }
    }

    /// Turn message faults on (with these rates) or off.
    pub fn set_faults(&mut self, faults: NetFaults) {
        self.faults = faults;
    }

    fn one_way(&self, rng: &mut Rng, node: usize) -> Duration {
        let jitter = u64::try_from(self.jitter_max[node].as_micros()).unwrap_or(0);
        self.latency_min[node] + Duration::from_micros(rng.range(0, jitter))
    }

    fn blocked(&self, node: usize, dir: Dir, now: Instant) -> Option<Instant> {
        let until = self.blocked_until[node][dir.index()];
        (until > now).then_some(until)
    }

    /// Block `node`'s link for `duration` (extends a running partition).
    pub fn partition(
        &mut self,
        node: usize,
        kind: PartitionKind,
        now: Instant,
        duration: Duration,
    ) {
        let until = now + duration;
        let dirs: &[Dir] = match kind {
            PartitionKind::Symmetric => &[Dir::EdgeToNode, Dir::NodeToEdge],
            PartitionKind::EdgeToNode => &[Dir::EdgeToNode],
            PartitionKind::NodeToEdge => &[Dir::NodeToEdge],
        };
        for dir in dirs {
            let slot = &mut self.blocked_until[node][dir.index()];
            *slot = (*slot).max(until);
        }
    }

    /// Heal every partition now (faults stop).
    pub fn heal(&mut self, now: Instant) {
        for slots in &mut self.blocked_until {
            for slot in slots {
                *slot = (*slot).min(now);
            }
        }
    }

    /// Whether any direction of `node`'s link is blocked at `now`.
    pub fn is_partitioned(&self, node: usize, now: Instant) -> bool {
        self.blocked(node, Dir::EdgeToNode, now).is_some()
            || self.blocked(node, Dir::NodeToEdge, now).is_some()
    }

    /// A node dials the Edge. Returns the new connection and when the
    /// handshake completes, or `None` if the dial will fail (Edge down or
    /// link partitioned).
    pub fn dial(
        &mut self,
        rng: &mut Rng,
        now: Instant,
        node: usize,
        edge_incarnation: Option<u64>,
    ) -> Option<(ConnId, Instant)> {
        let edge_incarnation = edge_incarnation?;
        if self.is_partitioned(node, now) {
            return None;
        }
        let id = ConnId(self.next_conn);
        self.next_conn += 1;
        self.conns.insert(
            id,
            ConnState {
                node,
                edge_incarnation,
                alive: true,
            },
        );
        // Handshake: one round trip.
        let rtt = self.one_way(rng, node) + self.one_way(rng, node);
        Some((id, now + rtt))
    }

    /// The node at the other end of `conn`.
    pub fn node_of(&self, conn: ConnId) -> Option<usize> {
        self.conns.get(&conn).map(|c| c.node)
    }

    /// The Edge incarnation `conn` was accepted by.
    pub fn edge_incarnation_of(&self, conn: ConnId) -> Option<u64> {
        self.conns.get(&conn).map(|c| c.edge_incarnation)
    }

    /// Whether `conn` is still up at the network level.
    pub fn is_alive(&self, conn: ConnId) -> bool {
        self.conns.get(&conn).is_some_and(|c| c.alive)
    }

    /// The connection is over (closed by a side, killed, or a process
    /// died): nothing more is delivered on it, except a close frame already
    /// in flight.
    pub fn close(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.alive = false;
        }
        self.last_arrival.retain(|(c, _, _), _| *c != conn);
    }

    /// The Edge process of `incarnation` died: every connection it had or
    /// was being dialed on dies with it.
    pub fn close_incarnation(&mut self, incarnation: u64) {
        let dead: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.alive && c.edge_incarnation == incarnation)
            .map(|(id, _)| *id)
            .collect();
        for conn in dead {
            self.close(conn);
        }
    }

    /// Send a message; say whether and when it arrives.
    pub fn send(
        &mut self,
        rng: &mut Rng,
        now: Instant,
        conn: ConnId,
        dir: Dir,
        stream: StreamKey,
        payload: &Payload,
    ) -> SendOutcome {
        let Some(state) = self.conns.get(&conn).copied() else {
            return SendOutcome::Dead;
        };
        if !state.alive {
            return SendOutcome::Dead;
        }
        let node = state.node;
        if payload.is_heartbeat() && rng.chance(self.faults.heartbeat_loss_ppm) {
            self.lost += 1;
            return SendOutcome::Lost;
        }
        if stream == StreamKey::Close {
            // A close frame is sent once: into a partition it is lost.
            if self.blocked(node, dir, now).is_some() {
                self.lost += 1;
                return SendOutcome::Lost;
            }
            return SendOutcome::Deliver(now + self.one_way(rng, node));
        }
        if rng.chance(self.faults.conn_kill_ppm) {
            self.killed += 1;
            self.close(conn);
            return SendOutcome::Killed;
        }
        let mut arrival = now + self.one_way(rng, node);
        if rng.chance(self.faults.retransmit_ppm) {
            // Head-of-line blocking within the stream only (QUIC).
            self.retransmitted += 1;
            let max_us = u64::try_from(self.faults.retransmit_max.as_micros()).unwrap_or(0);
            arrival += Duration::from_micros(rng.range(max_us / 4, max_us));
        }
        if let Some(until) = self.blocked(node, dir, now) {
            // Held and retransmitted once the partition heals.
            arrival = arrival.max(until + self.latency_min[node]);
        }
        let last = self
            .last_arrival
            .entry((conn, dir, stream))
            .or_insert(Instant::ZERO);
        // FIFO per stream: never before the previous message of the stream
        // (ties keep send order in the event queue).
        arrival = arrival.max(*last);
        *last = arrival;
        SendOutcome::Deliver(arrival)
    }

    /// A one-way delay on `node`'s link (for close notices).
    pub fn delay(&self, rng: &mut Rng, node: usize) -> Duration {
        self.one_way(rng, node)
    }

    /// Forget the FIFO bookkeeping of a finished stream.
    pub fn stream_done(&mut self, conn: ConnId, stream: StreamKey) {
        self.last_arrival.remove(&(conn, Dir::EdgeToNode, stream));
        self.last_arrival.remove(&(conn, Dir::NodeToEdge, stream));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iop_wire::{Heartbeat, NodeControl};

    fn net() -> (Network, Rng) {
        let mut config = SimConfig::from_seed(1);
        config.nodes = 1;
        config.latency_min = vec![Duration::from_millis(10)];
        config.jitter_max = vec![Duration::from_millis(30)];
        (Network::new(&config), Rng::new(1))
    }

    fn ping() -> Payload {
        Payload::NodeControl(NodeControl::Ping(Heartbeat { seq: 1 }))
    }

    #[test]
    fn one_stream_stays_in_order_while_streams_interleave() {
        let (mut n, mut rng) = net();
        let (c, _) = n.dial(&mut rng, Instant::ZERO, 0, Some(0)).unwrap();
        let mut last = Instant::ZERO;
        let mut crossed = false;
        for i in 0..200u64 {
            let now = Instant::from_micros(i * 100);
            let SendOutcome::Deliver(a) = n.send(
                &mut rng,
                now,
                c,
                Dir::NodeToEdge,
                StreamKey::Control,
                &ping(),
            ) else {
                panic!("no faults configured");
            };
            assert!(a >= last, "control stream reordered");
            last = a;
            let SendOutcome::Deliver(b) = n.send(
                &mut rng,
                now,
                c,
                Dir::NodeToEdge,
                StreamKey::Run(i),
                &ping(),
            ) else {
                panic!("no faults configured");
            };
            crossed |= b < a;
        }
        assert!(crossed, "different streams never interleaved");
    }

    #[test]
    fn partition_holds_traffic_and_blocks_dials_and_close_frames() {
        let (mut n, mut rng) = net();
        let (c, _) = n.dial(&mut rng, Instant::ZERO, 0, Some(0)).unwrap();
        n.partition(
            0,
            PartitionKind::NodeToEdge,
            Instant::ZERO,
            Duration::from_secs(5),
        );
        let SendOutcome::Deliver(at) = n.send(
            &mut rng,
            Instant::ZERO,
            c,
            Dir::NodeToEdge,
            StreamKey::Control,
            &ping(),
        ) else {
            panic!()
        };
        assert!(at >= Instant::from_millis(5000));
        let SendOutcome::Deliver(at) = n.send(
            &mut rng,
            Instant::ZERO,
            c,
            Dir::EdgeToNode,
            StreamKey::Control,
            &ping(),
        ) else {
            panic!()
        };
        assert!(at < Instant::from_millis(100), "one-way partition");
        assert_eq!(
            n.send(
                &mut rng,
                Instant::ZERO,
                c,
                Dir::NodeToEdge,
                StreamKey::Close,
                &Payload::Close(CloseCode::Normal)
            ),
            SendOutcome::Lost
        );
        assert!(n.dial(&mut rng, Instant::ZERO, 0, Some(0)).is_none());
        n.heal(Instant::from_millis(1));
        assert!(
            n.dial(&mut rng, Instant::from_millis(1), 0, Some(0))
                .is_some()
        );
    }

    proptest::proptest! {
        /// Whatever the sends (streams, gaps, partitions), each stream of
        /// each direction delivers in send order, and nothing arrives
        /// before it was sent.
        #[test]
        fn every_stream_is_fifo_under_any_schedule(
            seed in proptest::prelude::any::<u64>(),
            sends in proptest::collection::vec((0u8..4, 0u8..2, 0u64..20_000, proptest::bool::weighted(0.05)), 1..200),
        ) {
            let (mut n, _) = net();
            let mut rng = Rng::new(seed);
            let (c, _) = n.dial(&mut rng, Instant::ZERO, 0, Some(0)).expect("dial");
            let mut now = Instant::ZERO;
            let mut last: BTreeMap<(Dir, StreamKey), Instant> = BTreeMap::new();
            for (stream, dir, gap_us, partition) in sends {
                now += Duration::from_micros(gap_us);
                if partition {
                    n.partition(0, PartitionKind::Symmetric, now, Duration::from_millis(50));
                }
                let stream = match stream {
                    0 => StreamKey::Control,
                    s => StreamKey::Run(u64::from(s)),
                };
                let dir = if dir == 0 { Dir::EdgeToNode } else { Dir::NodeToEdge };
                if let SendOutcome::Deliver(at) = n.send(&mut rng, now, c, dir, stream, &ping()) {
                    proptest::prop_assert!(at >= now);
                    let prev = last.insert((dir, stream), at).unwrap_or(Instant::ZERO);
                    proptest::prop_assert!(at >= prev, "stream {:?} reordered", stream);
                }
            }
        }
    }

    #[test]
    fn a_closed_connection_delivers_nothing() {
        let (mut n, mut rng) = net();
        let (c, _) = n.dial(&mut rng, Instant::ZERO, 0, Some(0)).unwrap();
        n.close(c);
        assert_eq!(
            n.send(
                &mut rng,
                Instant::ZERO,
                c,
                Dir::EdgeToNode,
                StreamKey::Control,
                &ping()
            ),
            SendOutcome::Dead
        );
        assert!(
            n.dial(&mut rng, Instant::ZERO, 0, None).is_none(),
            "edge down"
        );
    }
}
