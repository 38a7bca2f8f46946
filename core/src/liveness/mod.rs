//! Liveness machinery shared by both sides: heartbeats and reconnect backoff.

pub mod backoff;
pub mod heartbeat;
