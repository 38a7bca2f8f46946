//! # iop-node
//!
//! The Node agent: dials out to the Edge over QUIC with mutual TLS,
//! registers its providers, completes readiness, keeps the connection live
//! with heartbeats, and executes normalized runs and raw provider tunnels
//! under the core's stall watchdog.

pub mod adapter;
pub mod config;
pub mod mock;
