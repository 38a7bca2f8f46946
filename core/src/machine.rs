//! The shape every driven machine of this crate shares (see the crate docs'
//! driver loop), as a trait, so a driver can be written once for any of
//! them: `iop_trace::Driven`, the one driver helper every shell task and the
//! simulator hold each machine in (feed, drain and record, fire the timer).
//!
//! ## Which objects are machines
//!
//! Every object a shell task or the simulator drives with inputs, outputs
//! and a timer is a [`Machine`], with one input and one output enum:
//! `Dispatcher`, `Request`, `EdgeLink`, `NodeLink`, `NodeRun`, `Custody`,
//! `Tenants`, the store's `Availability`, and `Heartbeat` (driven inside
//! both links). A machine may answer a synchronous question directly, by
//! the call's return value, as quinn-proto and str0m do: a driver never
//! hunts for an answer among the outputs. Where a trace must replay the
//! question, the machine names its questions and answers as [`Answers`]
//! (`NodeLink`: a run's start, its provider outputs' offer, an
//! observation number); questions that are not replayed are plain methods
//! (`Tenants::admit`, asked under the Edge's lock; `NodeLink::open_lease`,
//! whose answer is a secret and never recorded).
//!
//! The rest of the crate's stateful types are not driven on their own,
//! each for a reason its module gives:
//!
//! * parts of one machine, fed only by it: the dispatcher's `Registry`,
//!   `Admission`, `Overlay`, `HealthTracker` and `GenerationReserve`; the
//!   request's `StreamGate`; the node connection's `Watchdog` and
//!   `NodeLeases`; the run's `RunPark`; the custody's `TakeoverScan`
//!   (their fuzzers and property tests drive them directly);
//! * shared decisions asked under a lock, with no output queue:
//!   `Connections` (every client connection's task asks it and keeps its
//!   own timer), `NodeCapacity` (every node connection asks it), the
//!   credential `ProfileBook` and `ReplayCache`, `StoreReads` (every
//!   request that reads the journal asks it);
//! * schedules and queues a driver computes with: `Backoff` and
//!   `Reconnect` (a delay asked for when an attempt ends), the journal's
//!   `GroupCommit` (the store writer's bounded batch queue).

use crate::time::Instant;

/// A sans-IO state machine: typed inputs in, typed outputs out, one timer.
///
/// Besides its constructor, these four methods are a machine's whole
/// driving API; anything else it offers is read access (or, documented
/// where it is, a query whose answer must not be queued, such as a secret).
pub trait Machine {
    /// Everything that can happen to the machine.
    type Input;
    /// Everything the machine asks its driver to do.
    type Output;

    /// Feed one input at `now`; drain [`Machine::poll_output`] after.
    fn handle_input(&mut self, now: Instant, input: Self::Input);

    /// The next output to carry out, in order, until `None`.
    fn poll_output(&mut self) -> Option<Self::Output>;

    /// The earliest moment [`Machine::handle_timeout`] is due, if any.
    fn poll_timeout(&self) -> Option<Instant>;

    /// Fire what is due at `now` (calling it early is harmless).
    fn handle_timeout(&mut self, now: Instant);
}

/// A [`Machine`] that answers some questions directly: the return value of
/// [`Answers::answer`] is the answer (never an output); anything else the
/// question causes is drained with [`Machine::poll_output`] after, like an
/// input's outputs.
pub trait Answers: Machine {
    /// Every question the machine answers directly.
    type Query;
    /// Its answers (one kind per kind of question).
    type Answer;

    /// Answer `query` at `now`.
    fn answer(&mut self, now: Instant, query: Self::Query) -> Self::Answer;
}

/// Implement [`Machine`] by the inherent methods of the same names.
macro_rules! machine_by_inherent_methods {
    ($machine:ty, $input:ty, $output:ty) => {
        impl $crate::machine::Machine for $machine {
            type Input = $input;
            type Output = $output;
            fn handle_input(&mut self, now: $crate::time::Instant, input: $input) {
                <$machine>::handle_input(self, now, input);
            }
            fn poll_output(&mut self) -> Option<$output> {
                <$machine>::poll_output(self)
            }
            fn poll_timeout(&self) -> Option<$crate::time::Instant> {
                <$machine>::poll_timeout(self)
            }
            fn handle_timeout(&mut self, now: $crate::time::Instant) {
                <$machine>::handle_timeout(self, now);
            }
        }
    };
}

machine_by_inherent_methods!(
    crate::edge::dispatch::Dispatcher,
    crate::edge::dispatch::DispatchInput,
    crate::edge::dispatch::DispatchOutput
);
machine_by_inherent_methods!(
    crate::edge::request::Request,
    crate::edge::request::RequestInput,
    crate::edge::request::RequestOutput
);
machine_by_inherent_methods!(
    crate::edge::link::EdgeLink,
    crate::edge::link::EdgeLinkInput,
    crate::edge::link::EdgeLinkOutput
);
machine_by_inherent_methods!(
    crate::liveness::heartbeat::Heartbeat,
    crate::liveness::heartbeat::HeartbeatInput,
    crate::liveness::heartbeat::HeartbeatOutput
);
machine_by_inherent_methods!(
    crate::node::link::NodeLink,
    crate::node::link::NodeLinkInput,
    crate::node::link::NodeLinkOutput
);
impl Answers for crate::node::link::NodeLink {
    type Query = crate::node::link::NodeLinkQuery;
    type Answer = crate::node::link::NodeLinkAnswer;
    fn answer(&mut self, now: Instant, query: Self::Query) -> Self::Answer {
        crate::node::link::NodeLink::answer(self, now, query)
    }
}
machine_by_inherent_methods!(
    crate::edge::custody::Custody,
    crate::edge::custody::CustodyInput,
    crate::edge::custody::CustodyOutput
);
machine_by_inherent_methods!(
    crate::tenant::Tenants,
    crate::tenant::TenantsInput,
    crate::tenant::TenantsOutput
);
machine_by_inherent_methods!(
    crate::journal::availability::Availability,
    crate::journal::availability::AvailabilityInput,
    crate::journal::availability::AvailabilityOutput
);
