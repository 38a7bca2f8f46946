//! # iop-edge
//!
//! The Edge gateway: accepts Node connections over QUIC with mutual TLS,
//! fences their generations, and serves the OpenAI and Ollama APIs to
//! clients, with every policy decision made by `iop-core`.

pub mod admin;
pub mod admit;
pub mod answer_body;
pub mod api;
pub mod app_state;
pub mod catalog;
pub mod config;
pub mod console;
pub mod console_sessions;
pub mod cred;
pub mod custody;
pub mod decoded_size;
pub mod driver;
pub mod durable;
pub mod fuzzing;
pub mod genai;
pub mod generation_store;
pub mod http;
pub mod hub;
pub mod in_flight;
pub mod keyring;
pub mod keys_cli;
pub mod metrics;
pub mod node_link;
pub mod observe;
pub mod request_body;
pub mod request_record;
pub mod serve;
pub mod server;
pub mod server_timing;
pub mod status;
pub mod store_reads;
pub mod stored;
pub mod tenancy;
