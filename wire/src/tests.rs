use proptest::prelude::*;

use crate::*;

/// Finite floats only: NaN never equals itself, which would fail a round trip
/// for reasons that have nothing to do with the codec.
pub(crate) fn finite_f32() -> impl Strategy<Value = Option<f32>> {
    proptest::option::of(-1.0e6f32..1.0e6f32)
}

pub(crate) fn top_logprob() -> impl Strategy<Value = (String, f32)> {
    (".{0,4}", -1.0e6f32..1.0e6f32)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 1000,
        ..ProptestConfig::default()
    }
}

fn assert_round_trip<T>(value: &T)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let frame = encode_frame(value).unwrap();
    let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
    assert_eq!(len, frame.len() - 4, "length prefix matches payload");
    let back: T = decode(&frame[4..]).unwrap();
    assert_eq!(&back, value);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn node_control_round_trips(m in any::<NodeControl>()) { assert_round_trip(&m); }

    #[test]
    fn edge_control_round_trips(m in any::<EdgeControl>()) { assert_round_trip(&m); }

    #[test]
    fn data_request_round_trips(m in any::<DataRequest>()) { assert_round_trip(&m); }

    #[test]
    fn run_event_round_trips(m in any::<RunEvent>()) { assert_round_trip(&m); }

    #[test]
    fn tunnel_frame_round_trips(m in any::<ProviderTunnelFrame>()) { assert_round_trip(&m); }

    #[test]
    fn command_result_round_trips(m in any::<CommandResult>()) { assert_round_trip(&m); }

    #[test]
    fn register_response_round_trips(m in any::<RegisterResponse>()) { assert_round_trip(&m); }

    /// A stream of frames split at arbitrary points decodes to the same messages.
    #[test]
    fn frames_split_anywhere_decode_in_order(
        msgs in proptest::collection::vec(any::<RunEvent>(), 1..8),
        splits in proptest::collection::vec(1usize..64, 1..64),
    ) {
        let mut bytes = Vec::new();
        for m in &msgs { encode_frame_into(m, &mut bytes).unwrap(); }
        let mut decoder = FrameDecoder::default();
        let mut out = Vec::new();
        let mut rest = &bytes[..];
        let mut i = 0;
        while !rest.is_empty() {
            let n = splits[i % splits.len()].min(rest.len());
            decoder.push(&rest[..n]).unwrap();
            rest = &rest[n..];
            i += 1;
            while let Some(m) = decoder.next_message::<RunEvent>().unwrap() { out.push(m); }
        }
        decoder.finish().unwrap();
        prop_assert_eq!(out, msgs);
    }

    /// Arbitrary bytes at arbitrary splits never panic: each frame either
    /// decodes or yields a typed error.
    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        fuzzing::fuzz_frames(&data);
    }

    #[test]
    fn arbitrary_payload_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::fuzz_message(&data);
    }
}

#[test]
fn oversize_length_prefix_is_rejected_before_allocation() {
    let mut decoder = FrameDecoder::new(1024);
    let err = decoder.push(&u32::MAX.to_be_bytes()).unwrap_err();
    assert_eq!(
        err,
        WireError::FrameTooLarge {
            len: u64::from(u32::MAX),
            max: 1024
        }
    );
    // Nothing was reserved for the announced length.
    assert!(decoder.buffered() < 16);
    // The decoder stays poisoned.
    assert!(decoder.next_frame().is_err());
    assert_eq!(err.stream_error_code(), StreamErrorCode::FrameTooLarge);
}

#[test]
fn frame_at_exactly_the_maximum_is_accepted_and_one_more_is_not() {
    let mut ok = FrameDecoder::new(8);
    ok.push(&8u32.to_be_bytes()).unwrap();
    ok.push(&[0u8; 8]).unwrap();
    assert_eq!(ok.next_frame().unwrap(), Some(vec![0u8; 8]));
    let mut too_big = FrameDecoder::new(8);
    assert!(matches!(
        too_big.push(&9u32.to_be_bytes()),
        Err(WireError::FrameTooLarge { len: 9, max: 8 })
    ));
}

#[test]
fn truncated_stream_is_a_typed_error() {
    let frame = encode_frame(&NodeControl::Ping(Heartbeat { seq: 7 })).unwrap();
    let mut decoder = FrameDecoder::default();
    decoder.push(&frame[..frame.len() - 1]).unwrap();
    assert_eq!(decoder.next_frame().unwrap(), None);
    assert!(matches!(decoder.finish(), Err(WireError::Truncated { .. })));
}

#[test]
fn garbage_payload_is_malformed_not_a_panic() {
    let mut decoder = FrameDecoder::default();
    decoder.push(&[0, 0, 0, 3, 0xff, 0xff, 0xff]).unwrap();
    let err = decoder.next_message::<NodeControl>().unwrap_err();
    assert_eq!(err.stream_error_code(), StreamErrorCode::Malformed);
}

#[test]
fn trailing_bytes_are_refused() {
    let mut payload = postcard::to_stdvec(&Heartbeat { seq: 1 }).unwrap();
    payload.push(0);
    assert_eq!(
        decode::<Heartbeat>(&payload),
        Err(WireError::TrailingBytes(1))
    );
}

#[test]
fn closed_enums_parse_their_own_names() {
    for c in FailureCode::ALL {
        assert_eq!(FailureCode::parse(c.as_str()), Some(*c));
    }
    for c in CloseCode::ALL {
        assert_eq!(CloseCode::from_code(u64::from(c.code())), Some(*c));
    }
    for c in StreamErrorCode::ALL {
        assert_eq!(StreamErrorCode::from_code(u64::from(c.code())), Some(*c));
    }
    assert_eq!(HealthFailureCode::parse("nope"), None);
}

#[test]
fn health_pairs_follow_r_wd_5() {
    assert_eq!(
        ProviderHealth::Available.liveness_classification(),
        LivenessClassification::RequestStalled
    );
    assert_eq!(
        ProviderHealth::Unavailable.liveness_classification(),
        LivenessClassification::ProviderUnhealthy
    );
    assert_eq!(
        ProviderHealth::Unknown.liveness_classification(),
        LivenessClassification::HealthUnknown
    );
}

/// Replays the committed fuzz seed corpus (fuzz/corpus/*) through the harnesses.
#[test]
fn fuzz_seed_corpus_replays_without_panic() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    let mut replayed = 0;
    for (target, harness) in [
        ("wire_frames", fuzzing::fuzz_frames as fn(&[u8])),
        ("wire_message", fuzzing::fuzz_message as fn(&[u8])),
    ] {
        let dir = root.join(target);
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir:?}: {e}"));
        for entry in entries {
            let path = entry.unwrap().path();
            harness(&std::fs::read(&path).unwrap());
            replayed += 1;
        }
    }
    assert!(
        replayed >= 4,
        "the seed corpus is committed ({replayed} files)"
    );
}

proptest! {
    #![proptest_config(config())]

    /// A trace context survives its `traceparent` text form (W3C level 1).
    #[test]
    fn trace_context_round_trips_through_traceparent(cx in any::<TraceContext>()) {
        let text = cx.to_traceparent();
        prop_assert_eq!(text.len(), 55);
        let parsed = TraceContext::from_traceparent(&text);
        if cx.is_valid() {
            prop_assert_eq!(parsed, Some(cx));
        } else {
            prop_assert_eq!(parsed, None, "an all-zero id is invalid");
        }
    }

    /// Any header text parses to a valid context or to nothing, never a panic.
    #[test]
    fn arbitrary_traceparent_text_never_panics(text in ".{0,80}") {
        if let Some(cx) = TraceContext::from_traceparent(&text) {
            prop_assert!(cx.is_valid());
        }
    }
}

#[test]
fn traceparent_parses_the_w3c_example_and_refuses_malformed_values() {
    let cx =
        TraceContext::from_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .unwrap();
    assert_eq!(cx.trace_id[0], 0x4b);
    assert_eq!(cx.parent_span_id[7], 0xb7);
    assert!(cx.is_sampled());
    for bad in [
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ] {
        assert_eq!(TraceContext::from_traceparent(bad), None, "{bad}");
    }
}

/// The byte payloads (tunnel bodies, request bodies, credential leases) are
/// serialized as byte strings, one copy instead of one call per byte; in
/// postcard that is the same encoding a plain `Vec<u8>` had (a varint
/// length, then the bytes), so Edges and Nodes of either build understand
/// each other.
mod byte_fields_keep_the_wire_format {
    use super::*;

    /// `ProviderTunnelFrame` as it was declared before: the variants in the
    /// same order, `Body` a plain sequence of `u8`.
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    enum PlainTunnelFrame {
        Head { status: u16, headers: Vec<Header> },
        Body(Vec<u8>),
        End,
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn a_tunnel_body_encodes_as_a_plain_byte_vector(
            body in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let ours = encode_frame(&ProviderTunnelFrame::Body(body.clone())).unwrap();
            let plain = encode_frame(&PlainTunnelFrame::Body(body.clone())).unwrap();
            prop_assert_eq!(&ours, &plain);
            let back: PlainTunnelFrame = decode(&ours[4..]).unwrap();
            prop_assert_eq!(back, PlainTunnelFrame::Body(body.clone()));
            let back: ProviderTunnelFrame = decode(&plain[4..]).unwrap();
            prop_assert_eq!(back, ProviderTunnelFrame::Body(body));
        }

        #[test]
        fn an_optional_lease_encodes_as_a_plain_optional_vector(
            lease in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..300)),
        ) {
            #[derive(serde::Serialize)]
            struct Ours<'a>(#[serde(with = "serde_bytes")] &'a Option<Vec<u8>>);
            let ours = postcard::to_allocvec(&Ours(&lease)).unwrap();
            let plain = postcard::to_allocvec(&lease).unwrap();
            prop_assert_eq!(ours, plain);
        }
    }
}

#[test]
fn a_provider_message_is_stripped_of_control_characters_and_bounded() {
    assert_eq!(
        provider_message("  Input should be\r\n'text'\tor\u{1b}[31m 'json_object'\u{0} ")
            .as_deref(),
        Some("Input should be 'text' or [31m 'json_object'")
    );
    assert_eq!(provider_message(" \n\t "), None);
    let long = "x".repeat(MAX_PROVIDER_MESSAGE_CHARS * 3);
    let cut = provider_message(&long).unwrap();
    assert_eq!(cut.chars().count(), MAX_PROVIDER_MESSAGE_CHARS);
    assert!(cut.ends_with('…'));
    let exact = "é".repeat(MAX_PROVIDER_MESSAGE_CHARS);
    assert_eq!(provider_message(&exact).as_deref(), Some(exact.as_str()));
}

#[test]
fn a_provider_message_over_its_bound_is_refused_while_decoding() {
    let mut failure = ExecutionFailure::new(FailureCode::ProviderError);
    failure.provider_message = Some("y".repeat(MAX_PROVIDER_MESSAGE_CHARS * 4));
    let event = RunEvent {
        run_id: 1,
        kind: RunEventKind::Failed(failure.clone()),
    };
    let bytes = postcard::to_allocvec(&event).unwrap();
    assert!(decode::<RunEvent>(&bytes).is_ok());
    failure.provider_message = Some("y".repeat(MAX_PROVIDER_MESSAGE_CHARS * 4 + 1));
    let event = RunEvent {
        run_id: 1,
        kind: RunEventKind::Failed(failure),
    };
    let bytes = postcard::to_allocvec(&event).unwrap();
    assert!(decode::<RunEvent>(&bytes).is_err());
}
