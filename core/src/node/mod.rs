//! Node-side rules: the run limit over every Edge connection, the stall
//! watchdog, the connection-scoped session and
//! the classification of exact-target probe answers.

pub mod capacity;
pub mod park;
pub mod probe;
pub mod session;
pub mod watchdog;
