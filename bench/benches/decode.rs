//! The Node's per-chunk cost of normalized streaming, in provider chunks per
//! second (criterion's `elem/s`):
//!
//! * `node_decode/openai_whole_body`: a Chat Completions SSE answer of
//!   [`CHUNKS`] text chunks, in the mock provider's shape, served from
//!   memory over loopback HTTP in one write, read through the Node's
//!   `openai` adapter ([`Adapter::run`]) into run events. The adapter reads
//!   it in large pieces of many events each, as from a provider that is
//!   ahead of the Node.
//! * `node_decode/openai_event_per_write`: the same answer written one
//!   event at a time, the server yielding between events, so the adapter
//!   mostly reads one event per piece, as from a provider producing tokens
//!   one by one.
//!
//! Serving and the HTTP client are included, so this is the adapter as the
//! Node runs it, not the parser alone (the parser is private to the
//! adapter).
//!
//! Compare runs of this bench before and after a change on the same
//! machine. Run: `cargo bench -p iop-bench --bench decode`.

use std::hint::black_box;
use std::net::SocketAddr;

use axum::Router;
use axum::routing::post;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures::StreamExt;
use iop_node::adapter::Adapter;
use iop_node::config::ProviderTarget;
use iop_wire::{
    AdapterKind, ChatMessage, GenerationParams, Role, RunApi, RunEventKind, RunRequest,
};
use serde_json::json;

/// Text chunks per provider answer (one measured iteration).
const CHUNKS: u32 = 1_000;

/// The answer the mock provider streams for `CHUNKS` tokens with usage,
/// one SSE event per element.
fn provider_answer() -> Vec<String> {
    let chunk = |delta: serde_json::Value, finish: Option<&str>| {
        json!({
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    };
    let mut events = Vec::new();
    let mut data = |v: serde_json::Value| events.push(format!("data: {v}\n\n"));
    data(chunk(json!({"role": "assistant", "content": ""}), None));
    for i in 0..CHUNKS {
        data(chunk(
            json!({"content": iop_node::mock::token_text(i)}),
            None,
        ));
    }
    data(chunk(json!({}), Some("stop")));
    data(json!({
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": CHUNKS, "total_tokens": CHUNKS + 3},
    }));
    events.push("data: [DONE]\n\n".to_owned());
    events
}

fn run_request() -> RunRequest {
    RunRequest {
        run_id: 1,
        session_id: "s".into(),
        adapter: AdapterKind::OpenAi,
        target: "bench".into(),
        model: "m".into(),
        api: RunApi::Chat,
        messages: vec![ChatMessage {
            role: Role::User,
            content: "hi".into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            images: Vec::new(),
            cache_control: None,
            documents: Vec::new(),
        }],
        tools: Vec::new(),
        params: GenerationParams::default(),
        response_stall_timeout_ms: 0,
        deadline_ms: 0,
        credential_lease: None,
        trace_context: None,
        park: None,
        continue_final: false,
    }
}

fn node_decode(c: &mut Criterion) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let events: Vec<bytes::Bytes> = provider_answer().into_iter().map(Into::into).collect();
    let whole = bytes::Bytes::from(events.concat());
    let addr: SocketAddr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let sse = [("content-type", "text/event-stream")];
        let app = Router::new()
            .route(
                "/whole/v1/chat/completions",
                post(move || {
                    let whole = whole.clone();
                    async move { (sse, whole) }
                }),
            )
            .route(
                "/per-event/v1/chat/completions",
                post(move || {
                    let events = events.clone();
                    let body = futures::stream::iter(events).then(|event| async move {
                        tokio::task::yield_now().await;
                        Ok::<_, std::convert::Infallible>(event)
                    });
                    async move { (sse, axum::body::Body::from_stream(body)) }
                }),
            );
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    let http = iop_node::adapter::ProviderHttp::new();
    let adapter = |path: &str| {
        Adapter::new(
            &ProviderTarget {
                adapter: AdapterKind::OpenAi,
                target: "bench".into(),
                base_url: Some(format!("http://{addr}{path}")),
                models: vec!["m".into()],
                api_key: None,
                stream_usage: true,
                continuous_usage: false,
                whole_calls: true,
                json_object_schema: false,
                cache_control: true,
                max_concurrent_runs: None,
            },
            http.clone(),
        )
    };
    let whole_body = adapter("/whole");
    let event_per_write = adapter("/per-event");
    let decode = |adapter: &Adapter| {
        let mut events = adapter.run(run_request(), None);
        async move {
            let mut text_chunks = 0u32;
            let mut last = None;
            while let Some(event) = events.next().await {
                if matches!(event, RunEventKind::TextDelta(_)) {
                    text_chunks += 1;
                }
                last = Some(event);
            }
            (text_chunks, last)
        }
    };
    let mut group = c.benchmark_group("node_decode");
    group.throughput(Throughput::Elements(u64::from(CHUNKS)));
    for (name, adapter) in [
        ("openai_whole_body", &whole_body),
        ("openai_event_per_write", &event_per_write),
    ] {
        let (text_chunks, last) = runtime.block_on(decode(adapter));
        assert_eq!(text_chunks, CHUNKS);
        assert!(
            matches!(last, Some(RunEventKind::Completed { .. })),
            "{last:?}"
        );
        group.bench_function(name, |b| {
            b.iter(|| black_box(runtime.block_on(decode(adapter))));
        });
    }
    group.finish();
}

criterion_group!(benches, node_decode);
criterion_main!(benches);
