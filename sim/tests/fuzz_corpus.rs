//! Replays the committed seed corpus of the core fuzz targets
//! (`fuzz/corpus/core_dispatch/`, `fuzz/corpus/core_watchdog/`) through
//! the harnesses, so plain `cargo test` runs what `cargo fuzz` starts from.

use iop_sim::fuzzing::{fuzz_dispatch_sequence, fuzz_watchdog_sequence};

#[test]
fn core_fuzz_seed_corpus_replays_without_a_violation() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    for (target, harness) in [
        ("core_dispatch", fuzz_dispatch_sequence as fn(&[u8])),
        ("core_watchdog", fuzz_watchdog_sequence as fn(&[u8])),
    ] {
        let dir = root.join(target);
        let mut replayed = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir:?}: {e}")) {
            let path = entry.expect("a corpus entry").path();
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
            harness(&data);
            replayed += 1;
        }
        assert!(
            replayed >= 4,
            "the {target} seed corpus is committed ({replayed} files)"
        );
    }
}
