//! The failover invariants (SPEC §5): what a request may do after its
//! attempt failed, and what the Edge may do with a connection it no longer
//! hears from.
//!
//! | rule | checked |
//! | --- | --- |
//! | R-FAIL-1 | once an attempt of a request ended with an applied terminal whose `retryable` is false, that request is never dispatched again: no admission, no lease, no run sent (but a committed answer continued on its pool, R-CONT-1, on a route that opted in) |
//! | R-FAIL-2 | the Edge never grants a lease on, nor sends a run to, a node connection after its loss deadline (the last time the Edge heard from the peer plus the detection bound, or the moment the Edge declared it lost if that came first); after every step no generation is dispatchable past the loss deadline of its connection |
//!
//! ## The loss deadline
//!
//! The simulated network has no QUIC transport whose keep-alive could go
//! unacknowledged: a connection that dies without a close notice (loss that
//! kills it, a node crash, a frozen node, a partition) is found only by the
//! Edge's application heartbeat (`iop_core::liveness::heartbeat`), which
//! stands in here for R-FAIL-2's `loss_detect_ms` as well as for R-HB-1.
//! Its bound is `heartbeat_interval + heartbeat_wait` after the peer's last
//! answer: the first ping goes out one interval after the connection is
//! accepted; after an answer that arrives at `H` the next ping goes out at
//! `max(previous ping + interval, H) <= H + interval` (one ping is
//! outstanding at a time); an unanswered ping is declared dead `wait` after
//! it went out. So the Edge must have declared the connection lost by
//!
//! ```text
//! deadline = H + heartbeat_interval + heartbeat_wait
//! ```
//!
//! where `H` is the moment its heartbeat took the peer's last answer (a pong
//! that matched its outstanding ping) or, before any, the moment it accepted
//! the registration. Messages on data streams never count (R-HB-1: a long
//! prefill is not liveness). A loss declared earlier (a close frame, a
//! close notice, the heartbeat's own timeout) moves the deadline to that
//! moment: a connection declared lost is lost.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use iop_core::Instant;
use iop_core::edge::admission::{LeaseId, RequestId};
use iop_core::edge::dispatch::{Dispatcher, TerminalVerdict};
use iop_core::ids::{Generation, NodeId, ProviderId};
use iop_wire::ExecutionFailure;

use super::{Checker, remember};

/// What the checker knows of one Edge connection (a node's generation).
#[derive(Debug, Clone, Copy)]
struct LinkModel {
    /// When the Edge last heard from the peer (its heartbeat took an
    /// answer, or the registration was accepted).
    heard: Instant,
    /// When the Edge declared the connection lost.
    declared: Option<Instant>,
}

/// The failover part of the checker.
#[derive(Debug, Default)]
pub(super) struct FailoverModel {
    /// The detection bound: heartbeat interval plus wait.
    loss_bound: Duration,
    /// Edge connections of the current incarnation, by node and generation.
    links: BTreeMap<(NodeId, Generation), LinkModel>,
    /// Terminals sent to the dispatcher and not yet answered, by lease:
    /// whether the node marked the failure not retryable.
    pending: BTreeMap<LeaseId, bool>,
    /// Requests whose attempt ended with an applied terminal that is not
    /// retryable (R-FAIL-1), by Edge incarnation.
    closed: BTreeSet<(u64, RequestId)>,
}

impl Checker {
    /// The Edge's loss detection bound (heartbeat interval plus wait, see
    /// the [module docs](self)).
    pub fn set_loss_bound(&mut self, bound: Duration) {
        self.failover.loss_bound = bound;
    }

    /// A new Edge incarnation: no connection, no terminal pending.
    pub(super) fn failover_edge_started(&mut self) {
        self.failover.links.clear();
        self.failover.pending.clear();
    }

    // ---- R-FAIL-2 ------------------------------------------------------------

    /// The Edge completed `node`'s readiness on `generation` (its heartbeat
    /// starts now, as `iop-edge`'s does; before it the generation is not
    /// dispatchable). Older generations of the node are forgotten.
    pub fn link_opened(&mut self, node: &NodeId, generation: Generation) {
        let now = self.now;
        self.failover
            .links
            .retain(|(n, g), _| n != node || *g >= generation);
        self.failover.links.insert(
            (node.clone(), generation),
            LinkModel {
                heard: now,
                declared: None,
            },
        );
    }

    /// The Edge's heartbeat on `node`'s `generation` took an answer.
    pub fn link_heard(&mut self, node: &NodeId, generation: Generation) {
        let now = self.now;
        if let Some(l) = self.failover.links.get_mut(&(node.clone(), generation))
            && l.declared.is_none()
        {
            l.heard = l.heard.max(now);
        }
    }

    /// The Edge declared `node`'s connection of `generation` lost (or
    /// closed it).
    pub fn link_declared_lost(&mut self, node: &NodeId, generation: Generation) {
        let now = self.now;
        if let Some(l) = self.failover.links.get_mut(&(node.clone(), generation)) {
            l.declared = Some(l.declared.map_or(now, |d| d.min(now)));
        }
    }

    /// The moment by which the Edge must have declared the connection lost.
    fn loss_deadline(&self, node: &NodeId, generation: Generation) -> Option<Instant> {
        let l = self.failover.links.get(&(node.clone(), generation))?;
        let bound = l.heard + self.failover.loss_bound;
        Some(l.declared.map_or(bound, |d| d.min(bound)))
    }

    /// R-FAIL-2: the Edge dispatches (`what`: a lease granted, a run sent)
    /// to `node`'s connection of `generation`: never past its loss
    /// deadline.
    pub fn dispatch_to_link(&mut self, node: &NodeId, generation: Generation, what: &str) {
        let now = self.now;
        let Some(deadline) = self.loss_deadline(node, generation) else {
            return;
        };
        if now > deadline {
            let detail = format!(
                "{what} on {node} generation {generation} {}us past its connection's loss deadline (last heard + {}us, or declared lost)",
                (now - deadline).as_micros(),
                self.failover.loss_bound.as_micros()
            );
            self.fail("R-FAIL-2", detail);
        }
    }

    /// R-FAIL-2, after every step: no node's generation is dispatchable
    /// past its connection's loss deadline.
    pub fn check_links(&mut self, d: &Dispatcher, providers: &[(ProviderId, NodeId)]) {
        let now = self.now;
        for (_, node) in providers {
            let Some(g) = d.registry().dispatchable_generation(node) else {
                continue;
            };
            let Some(deadline) = self.loss_deadline(node, g) else {
                continue;
            };
            if now > deadline {
                let detail = format!(
                    "{node} generation {g} still dispatchable {}us past its connection's loss deadline",
                    (now - deadline).as_micros()
                );
                self.fail("R-FAIL-2", detail);
                return;
            }
        }
    }

    // ---- R-FAIL-1 ------------------------------------------------------------

    /// A request sends its attempt's terminal for `lease_id` to the
    /// dispatcher.
    pub fn terminal_sent(&mut self, lease_id: LeaseId, failure: Option<&ExecutionFailure>) {
        let unretryable = failure.is_some_and(|f| !f.retryable);
        self.failover.pending.insert(lease_id, unretryable);
    }

    /// The dispatcher's verdict on the terminal of `lease_id` reaches the
    /// request `key`: an applied terminal the node did not mark retryable
    /// ends the request's admissions (R-FAIL-1), unless `may_continue`:
    /// the request's answer is committed and its route continues answers
    /// (R-CONT-1 governs what comes after commit).
    pub fn terminal_verdict(
        &mut self,
        key: (u64, RequestId),
        lease_id: LeaseId,
        verdict: &TerminalVerdict,
        may_continue: bool,
    ) {
        let Some(unretryable) = self.failover.pending.remove(&lease_id) else {
            return;
        };
        if unretryable && !may_continue && matches!(verdict, TerminalVerdict::Applied { .. }) {
            remember(&mut self.failover.closed, key);
        }
    }

    /// R-FAIL-1: request `key` is dispatched (`what`: admitted, leased, a
    /// run sent): never after an attempt of it ended with a terminal that
    /// is not retryable.
    pub fn request_dispatched(&mut self, key: (u64, RequestId), what: &str) {
        if self.failover.closed.contains(&key) {
            let detail = format!(
                "request {key:?} {what} after an attempt ended with a terminal that is not retryable"
            );
            self.fail("R-FAIL-1", detail);
        }
    }
}
