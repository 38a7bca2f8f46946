//! Node-side rules: the stall watchdog and the connection-scoped session.

pub mod session;
pub mod watchdog;
