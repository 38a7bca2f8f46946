//! Arbitrary bytes, split at arbitrary points, through the frame decoder.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_wire::fuzzing::fuzz_frames(data));
