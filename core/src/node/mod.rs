//! Node-side rules: the run limit over every Edge connection, one
//! connection's machine ([`link::NodeLink`]: handshake, heartbeat, the stall
//! watchdog, each run's one terminal, its leases), the stall
//! watchdog, the connection-scoped session,
//! the classification of exact-target probe answers and of failed provider
//! calls.

pub mod capacity;
pub mod link;
pub mod park;
pub mod probe;
pub mod provider;
pub mod run;
pub mod session;
pub mod watchdog;
