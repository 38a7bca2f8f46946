//! Writes the fuzz seed corpus: `cargo run -p iop-wire --example wire_fuzz_seeds -- fuzz/corpus`.
//!
//! The seeds are valid frames of every stream's message types, so the fuzzers
//! start from the interesting part of the input space.

use iop_wire::*;

fn main() -> std::io::Result<()> {
    let root = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or("fuzz/corpus".into()));
    let failure = ExecutionFailure {
        code: FailureCode::ResponseStalled,
        retryable: true,
        provider_health: Some(ProviderHealth::Available),
        liveness_classification: Some(LivenessClassification::RequestStalled),
        health_observation_seq: Some(3),
        stall: Some(StallMetadata {
            elapsed_ms: 1000,
            stall_timeout_ms: 1000,
        }),
        http_status: None,
        health_failure: Some(HealthFailureCode::ResponseStalled),
        provider_message: None,
    };
    let mut frames: Vec<(&str, Vec<u8>)> = vec![
        (
            "register",
            encode_frame(&NodeControl::Register(RegisterRequest {
                protocol_version: PROTOCOL_VERSION,
                node_version: "0.1.0".into(),
                providers: vec![OfferedProvider {
                    adapter: AdapterKind::Mock,
                    target: "mock".into(),
                    models: vec!["m".into()],
                    max_concurrent_runs: Some(2),
                }],
                max_concurrent_runs: 8,
                recipient_public_key: Some([7; 32]),
                parked: Vec::new(),
            }))
            .unwrap(),
        ),
        (
            "ping",
            encode_frame(&NodeControl::Ping(Heartbeat { seq: 9 })).unwrap(),
        ),
        (
            "registered",
            encode_frame(&EdgeControl::Registered(RegisterResponse::Accepted {
                generation: 4,
                config: ConfigSnapshot {
                    providers: vec![ProviderSnapshot {
                        provider_id: "p".into(),
                        adapter: AdapterKind::OpenAi,
                        target: "t".into(),
                        response_stall_timeout_ms: 0,
                    }],
                    credential_profiles: vec![CredentialProfileState {
                        profile: "c".into(),
                        revision: 2,
                        active: true,
                    }],
                    lease_signing_key: None,
                    managed_targets: Vec::new(),
                },
            }))
            .unwrap(),
        ),
        (
            "run",
            encode_frame(&DataRequest::Run(RunRequest {
                run_id: 1,
                session_id: "s".into(),
                adapter: AdapterKind::Mock,
                target: "mock".into(),
                model: "m".into(),
                api: RunApi::Chat,
                messages: vec![ChatMessage {
                    role: Role::User,
                    content: "hi".into(),
                    tool_calls: vec![],
                    tool_call_id: None,
                    name: None,
                    images: Vec::new(),
                    cache_control: None,
                    documents: Vec::new(),
                }],
                tools: vec![],
                params: GenerationParams {
                    max_tokens: Some(5),
                    ..Default::default()
                },
                response_stall_timeout_ms: 0,
                deadline_ms: 0,
                credential_lease: None,
                trace_context: Some(TraceContext {
                    trace_id: [0x4b; 16],
                    parent_span_id: [0x0f; 8],
                    flags: TraceContext::FLAG_SAMPLED,
                }),
                park: None,
                continue_final: false,
            }))
            .unwrap(),
        ),
        (
            "run_event",
            encode_frame(&RunEvent {
                run_id: 1,
                kind: RunEventKind::TextDelta("hello".into()),
            })
            .unwrap(),
        ),
        (
            "run_failed",
            encode_frame(&RunEvent {
                run_id: 1,
                kind: RunEventKind::Failed(failure.clone()),
            })
            .unwrap(),
        ),
        (
            "tunnel_head",
            encode_frame(&ProviderTunnelFrame::Head {
                status: 200,
                headers: vec![("content-type".into(), "text/event-stream".into())],
            })
            .unwrap(),
        ),
        (
            "command_caps",
            encode_frame(&CommandResult {
                command_id: 2,
                session_id: String::new(),
                body: CommandResultBody::Capabilities(CapabilitiesReport {
                    targets: vec![TargetHealth {
                        adapter: AdapterKind::Ollama,
                        target: "o".into(),
                        status: ProviderHealth::Unavailable,
                        failure_code: Some(HealthFailureCode::Http5xx),
                        models: vec![],
                    }],
                    health_observation_seq: 5,
                }),
            })
            .unwrap(),
        ),
    ];
    // Two frames back to back, and an oversize header.
    let mut two = frames[1].1.clone();
    two.extend_from_slice(&frames[4].1);
    frames.push(("two_frames", two));
    frames.push(("oversize", vec![0xff, 0xff, 0xff, 0xff, 1, 2, 3]));

    for (dir, split) in [("wire_frames", Some(3u8)), ("wire_message", None)] {
        let dir = root.join(dir);
        std::fs::create_dir_all(&dir)?;
        for (name, frame) in &frames {
            let bytes = match split {
                // fuzz_frames takes its split step from the first byte.
                Some(step) => [&[step][..], frame].concat(),
                None if frame.len() > 4 => frame[4..].to_vec(),
                None => continue,
            };
            std::fs::write(dir.join(format!("seed_{name}")), bytes)?;
        }
    }
    Ok(())
}
