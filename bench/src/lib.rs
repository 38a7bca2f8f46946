//! # iop-bench: load generator and end-to-end benchmarks
//!
//! * [`load`]: an OpenAI Chat Completions load generator, streamed or not,
//!   in open loop (a fixed request rate; latency measured from each
//!   request's *intended* send time, so a slow server cannot hide its
//!   queueing: no coordinated omission) or closed loop (a fixed number of
//!   concurrent clients). It reports p50/p90/p99/p99.9 of total latency,
//!   time to first token and inter-chunk gap, throughput and errors.
//! * [`report`]: the JSON report and its markdown tables.
//! * [`deployment`]: a real deployment as separate processes (the mock
//!   provider, `iop-edge run`, `iop-node run`, many nodes in one process) on
//!   loopback, with their RSS and CPU time read from `/proc`.
//! * [`scenario`]: the measured scenarios, each comparing against a baseline
//!   in the same run (direct to the mock).
//! * [`fleet`]: many Nodes in one process (the node-scale scenario).
//! * [`journal`]: the Edge's journal metrics read around a run (the durable
//!   scenario).
//! * [`spans`]: the Edge's and the Node's spans of each request, joined
//!   with what the client saw (the tail scenario: where the slowest
//!   requests' time went).
//! * [`tenants`]: limits and budgets on vs off on one Edge (the tenants
//!   scenario).
//! * [`durable_memory`]: the Edge's memory while durable responses are
//!   retained (the retention scenario) and while one large stored response
//!   is read back many times (the retrieve scenario).
//! * [`gateways`]: what the published gateway benchmarks report (one
//!   request at a time, the most requests/s under a p99 bound, peak
//!   memory) for the mock alone, iop and [`peers`] (Portkey's gateway,
//!   LiteLLM's proxy) in one run (the gateways scenario).
//!
//! Speed is reported as numbers and ratios against a baseline of the same
//! run, never asserted in tests: the tests here only check that the tools
//! run and that their reports are well-formed.
//!
//! See `docs/benchmarks.md` for the method and the measured tables.

pub mod deployment;
pub mod durable_memory;
pub mod fleet;
pub mod gateway;
pub mod gateways;
pub mod journal;
pub mod load;
pub mod peers;
pub mod procfs;
pub mod report;
pub mod scenario;
pub mod spans;
pub mod sse;
pub mod tenants;
