//! Arbitrary bytes as a client request body to the responses parser.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_edge::fuzzing::fuzz_responses(data));
