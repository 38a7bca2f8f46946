//! Arbitrary bytes as a sequence of Edge dispatcher inputs; the harness
//! checks the dispatch rules after each one.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_sim::fuzzing::fuzz_dispatch_sequence(data));
