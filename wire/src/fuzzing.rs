//! Fuzz harness bodies, kept in the library so `cargo test` on stable can
//! replay the committed seed corpus and `cargo fuzz` can drive the same code.
//!
//! Each harness must never panic on any input: a panic is a bug.

use crate::{
    CommandResult, DataRequest, EdgeControl, FrameDecoder, NodeControl, ProviderTunnelFrame,
    RunEvent, decode, encode_frame,
};

/// Feed `data` to a [`FrameDecoder`] split at the points the first bytes choose,
/// then decode every frame as every message type. Re-encoding a decoded
/// message must decode to the same value.
pub fn fuzz_frames(data: &[u8]) {
    let (split_seed, body) = match data.split_first() {
        Some((seed, rest)) => (usize::from(*seed), rest),
        None => return,
    };
    // The production limit (the largest, Edge -> Node): what a peer can
    // make a real decoder buffer and decode, memory blow-ups included.
    let mut decoder = FrameDecoder::new(crate::MAX_FRAME_LEN);
    let step = split_seed.max(1);
    for chunk in body.chunks(step) {
        if decoder.push(chunk).is_err() {
            return;
        }
        loop {
            match decoder.next_frame() {
                Ok(Some(payload)) => fuzz_message(&payload),
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = decoder.finish();
}

/// Decode `payload` as every message type a stream can carry; whatever
/// decodes must round-trip.
pub fn fuzz_message(payload: &[u8]) {
    round_trip::<NodeControl>(payload);
    round_trip::<EdgeControl>(payload);
    round_trip::<DataRequest>(payload);
    round_trip::<RunEvent>(payload);
    round_trip::<ProviderTunnelFrame>(payload);
    round_trip::<CommandResult>(payload);
}

fn round_trip<T>(payload: &[u8])
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    if let Ok(value) = decode::<T>(payload) {
        let frame = encode_frame(&value).expect("a decoded message re-encodes");
        let again: T = decode(&frame[4..]).expect("a re-encoded message decodes");
        // Compared as encodings: a NaN float is a valid value that is not
        // equal to itself.
        let frame_again = encode_frame(&again).expect("it re-encodes again");
        assert_eq!(
            frame, frame_again,
            "round trip changed the message: {value:?}"
        );
    }
}
