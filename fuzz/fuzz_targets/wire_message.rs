//! Arbitrary payloads decoded as every message type.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_wire::fuzzing::fuzz_message(data));
