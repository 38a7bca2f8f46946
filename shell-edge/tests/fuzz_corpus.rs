//! Replay the committed seed corpus of the API parser fuzz targets
//! (`fuzz/corpus/api_*`) through their harnesses on stable, so CI runs
//! every seed and every fixed crash on each change.

use std::path::Path;

use iop_edge::fuzzing::{fuzz_chat, fuzz_ollama, fuzz_responses};

#[test]
fn api_parser_seed_corpus_replays_without_a_violation() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    for (target, harness) in [
        ("api_chat", fuzz_chat as fn(&[u8])),
        ("api_responses", fuzz_responses as fn(&[u8])),
        ("api_ollama", fuzz_ollama as fn(&[u8])),
    ] {
        let dir = root.join(target);
        let mut replayed = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir:?}: {e}")) {
            let path = entry.unwrap().path();
            harness(&std::fs::read(&path).unwrap());
            replayed += 1;
        }
        assert!(replayed >= 3, "{target}: the seed corpus is committed");
    }
}

#[test]
fn api_parsers_refuse_deep_nesting_and_junk_with_client_errors() {
    // What an attacker with a key sends: deep arrays, huge junk arrays.
    let deep = format!(
        "{{\"model\":\"m\",\"messages\":{}{}}}",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    let junk = format!(
        "{{\"model\":\"m\",\"messages\":[{}0]}}",
        "0,".repeat(200_000)
    );
    for body in [
        deep.as_bytes(),
        junk.as_bytes(),
        b"",
        b"null",
        b"[]",
        b"{\"model\":\"\"}",
    ] {
        fuzz_chat(body);
        fuzz_responses(body);
        fuzz_ollama(body);
    }
}
