//! Arbitrary bytes as a sequence of Node watchdog inputs; the harness
//! checks the watchdog rules after each one.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_sim::fuzzing::fuzz_watchdog_sequence(data));
