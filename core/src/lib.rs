//! # iop-core: the rules, as sans-IO state machines
//!
//! Every fencing, liveness, health, admission and recovery rule of iop
//! (SPEC §4) is written here, once. The Edge and Node shells and the
//! simulator drive these machines; none of them decides policy.
//!
//! This crate never reads a clock, never sleeps, spawns, locks or touches a
//! socket, and never draws from a global RNG. Time arrives as an explicit
//! [`time::Instant`] on every input; randomness through an injected
//! [`rng::RandomSource`]. Any moment and any random sequence can therefore be
//! constructed by a test, the simulator, or a trace replay.
//!
//! ## The driver loop
//!
//! Every state machine here has the same shape (after quinn-proto and
//! str0m), and every driver (a shell task, the simulator) runs it the same
//! way:
//!
//! 1. **Feed inputs.** When something happens (a frame arrives, a provider
//!    returns, a client disconnects), call the matching `handle_*` method
//!    with the current `now`.
//! 2. **Drain outputs.** Call `poll_output()` (or `poll_event()`) until it
//!    returns `None`, and carry out each output: write a frame, cancel an
//!    HTTP call, start a probe, release a slot, emit a metric. Outputs are
//!    queued in the order the rules require; carry them out in that order.
//! 3. **Arm the timer.** Call `poll_timeout()`. It returns the earliest
//!    moment the machine needs to be woken, or `None`. Sleep until then or
//!    until the next input, whichever comes first.
//! 4. **Fire the timer.** When the moment passes, call `handle_timeout(now)`
//!    and go back to step 2.
//!
//! A driver must not skip step 2 after an input: outputs that are not
//! drained are not carried out. Calling `handle_timeout` early is harmless;
//! nothing fires before its moment.
//!
//! The machines a shell or the simulator drives directly have exactly
//! these entry points, one input enum and one output enum, and implement
//! [`Machine`]: the Edge's [`edge::dispatch::Dispatcher`] and per-request
//! [`edge::request::Request`] and per-node-connection
//! [`edge::link::EdgeLink`], the Edge's [`edge::custody::Custody`] and
//! [`tenant::Tenants`], and the Node's per-connection
//! [`node::link::NodeLink`] and per-run [`node::run::NodeRun`]. The
//! machines they compose keep narrower method APIs, called only by their
//! owner: admission, health, the stream gate, the watchdog and a run's
//! park; the [`liveness::heartbeat::Heartbeat`] is a
//! `Machine` too, composed by both links.
//!
//! ## Map
//!
//! * [`liveness`]: heartbeat liveness (R-HB-1, R-HB-2) and the reconnect
//!   backoff schedule, used by both sides.
//! * [`node`]: the Node's connection machine ([`node::link::NodeLink`]:
//!   handshake, heartbeat, watchdog, each run's one terminal, its leases),
//!   each run's machine ([`node::run::NodeRun`]: start order, what the
//!   watchdog lets through, park, adoption and replay), the run limit over
//!   every connection, the stall watchdog for runs and
//!   tunnels (R-WD-1..8),
//!   the connection-scoped observation sequence (R-SEQ-1) and what an
//!   exact-target probe answer means (R-WD-5, R-CAP-1) and what a failed
//!   provider call is on the wire (R-WD-6, R-WD-8).
//! * [`edge`]: the Edge's registry of node generations (R-GEN-1..4),
//!   admission and leases (R-LEASE, R-SEL), the runtime health overlay and
//!   CAPABILITIES recovery (R-OVL, R-CAP), the stream gate (R-GATE), the
//!   per-provider health tracker (R-HT), the limits on client connections
//!   and request bodies (R-LIM-1, R-LIM-2), and the per-request session
//!   machine ([`edge::request::Request`]) that owns one client request and
//!   talks to the [`edge::dispatch::Dispatcher`] in typed commands and
//!   events.
//! * [`cred`]: managed credential leases (R-CRED-1..3): sealing a secret
//!   to a Node under a signed scope, and opening it fail-closed with a
//!   bounded replay cache. Pure functions; RNG and time are injected.
//! * [`journal`]: the rules of durable responses (R-JRN-1..5, R-IDEM-1):
//!   numbering, writer-epoch fencing, one terminal, retention, byte bounds,
//!   group commit. Every store runs them inside its own transactions.
//! * [`retry`]: which failures another provider may answer (R-FAIL-1),
//!   shared by the Node's `retryable` mark and the Edge's failover.
//! * [`provider_usage`]: how each provider API's usage report reads,
//!   shared by the Node's adapters and the Edge's tunnel meter (R-TEN-2).
//! * `planted` (feature `planted-bugs`, test-only): known bugs a test can
//!   switch on to prove that the simulator's invariants catch them.

#![deny(missing_docs)]

pub mod cred;
pub mod edge;
pub mod ids;
pub mod journal;
pub mod liveness;
pub mod machine;
pub mod node;
#[cfg(feature = "planted-bugs")]
pub mod planted;
pub mod provider_usage;
pub mod retry;
pub mod rng;
pub mod tenant;
pub mod time;

pub use machine::{Answers, Machine};
pub use time::Instant;
