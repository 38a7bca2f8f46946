//! The Edge's per-chunk cost of normalized streaming, in chunks per second
//! (criterion's `elem/s`): [`CHUNKS`] text-delta run events rendered as the
//! SSE body of a Chat Completions stream, one delivery (and so one body
//! chunk) per event, as the Edge writes them when nothing is queued.
//!
//! * `edge_encode/value_tree`: the renderer the Edge used before, kept here
//!   as the baseline: a `serde_json::Value` built per chunk, serialized to a
//!   `String`, wrapped in one axum SSE `Event`;
//! * `edge_encode/typed`: [`ChatStream::push`], a typed struct serialized
//!   into one body buffer, the fixed fields written once per stream.
//!
//! Both render the same bytes (the unit tests of `iop_edge::api::chat`
//! pin them). Run: `cargo bench -p iop-bench --bench encode`.

use std::hint::black_box;

use axum::response::sse::Event;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iop_edge::api::chat::ChatStream;
use iop_wire::RunEventKind;
use serde_json::{Map, Value, json};

/// Text chunks per measured iteration.
const CHUNKS: u32 = 1_000;

const ID: &str = "chatcmpl-3f1b9d0c5a7e2468";
const MODEL: &str = "short";
const CREATED: u64 = 1_764_500_000;

/// The text deltas the mock provider streams (`tok0`, ` tok1`, ...).
fn text_events() -> Vec<RunEventKind> {
    (0..CHUNKS)
        .map(|i| RunEventKind::TextDelta(iop_node::mock::token_text(i)))
        .collect()
}

/// One text chunk as the Value-tree renderer built it.
fn value_tree_chunk(text: &str) -> Value {
    let mut chunk = Map::new();
    chunk.insert("id".into(), json!(ID));
    chunk.insert("object".into(), json!("chat.completion.chunk"));
    chunk.insert("created".into(), json!(CREATED));
    chunk.insert("model".into(), json!(MODEL));
    chunk.insert("system_fingerprint".into(), Value::Null);
    chunk.insert(
        "choices".into(),
        json!([{
            "index": 0,
            "delta": json!({ "content": text }),
            "logprobs": null,
            "finish_reason": Option::<&str>::None,
        }]),
    );
    Value::Object(chunk)
}

fn edge_encode(c: &mut Criterion) {
    let events = text_events();
    let mut group = c.benchmark_group("edge_encode");
    group.throughput(Throughput::Elements(u64::from(CHUNKS)));
    group.bench_function("value_tree", |b| {
        b.iter(|| {
            for event in &events {
                let RunEventKind::TextDelta(text) = event else {
                    unreachable!("text events only");
                };
                // One delivery: the chunks, then one SSE event per chunk.
                let chunks = vec![value_tree_chunk(text)];
                let frames: Vec<Event> = chunks
                    .into_iter()
                    .map(|json| Event::default().data(json.to_string()))
                    .collect();
                black_box(frames);
            }
        });
    });
    group.bench_function("typed", |b| {
        b.iter(|| {
            let mut stream = ChatStream::new(ID, MODEL, CREATED);
            let mut body = Vec::with_capacity(512);
            for event in &events {
                // One delivery: its frames, handed on as one body chunk.
                stream.push(event, &mut body);
                let capacity = body.len().max(512);
                let chunk = std::mem::replace(&mut body, Vec::with_capacity(capacity));
                black_box(bytes::Bytes::from(chunk));
            }
        });
    });
    group.finish();
}

criterion_group!(benches, edge_encode);
criterion_main!(benches);
