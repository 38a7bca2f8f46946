//! Arbitrary bytes as a client request body to the ollama parser.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_edge::fuzzing::fuzz_ollama(data));
