//! A tunnel body frame through the wire codec: encoded by the Node
//! ([`iop_wire::encode_frame_into`]) and decoded by the Edge
//! ([`iop_wire::FrameDecoder`]), in bytes per second (criterion's
//! `bytes/s`), at three body sizes: a provider's SSE chunk (150 bytes), a
//! read of several (4 KiB) and the largest body frame (64 KiB).
//!
//! * `tunnel_body/plain_vec`: the frame as it was declared before, `Body`
//!   a plain `Vec<u8>` that serde walks one `u8` at a time; kept here as
//!   the baseline;
//! * `tunnel_body/byte_string`: [`ProviderTunnelFrame::Body`] as declared
//!   now (`serde_bytes`): one length and one copy.
//!
//! Both produce the same bytes (the wire crate's tests pin it). Run:
//! `cargo bench -p iop-bench --bench wire`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use iop_wire::{FrameDecoder, ProviderTunnelFrame, encode_frame_into};
use serde::{Deserialize, Serialize};

/// `ProviderTunnelFrame` before: the same variants in the same order.
#[derive(Serialize, Deserialize)]
#[allow(dead_code)] // the other variants keep the variant indexes
enum PlainTunnelFrame {
    Head {
        status: u16,
        headers: Vec<(String, String)>,
    },
    Body(Vec<u8>),
    End,
}

/// Frames per measured iteration.
const FRAMES: usize = 64;

/// Each frame encoded, then pushed into the decoder and decoded, as the
/// Edge reads frames as they arrive.
fn round_trip<T: Serialize + for<'de> Deserialize<'de>>(frames: &[T], wire: &mut Vec<u8>) {
    let mut decoder = FrameDecoder::default();
    for frame in frames {
        wire.clear();
        encode_frame_into(frame, wire).expect("a body frame encodes");
        decoder.push(wire).expect("within the frame bound");
        let decoded = decoder.next_message::<T>().expect("well-formed");
        black_box(decoded.expect("one whole frame"));
    }
}

fn tunnel_body(c: &mut Criterion) {
    let mut group = c.benchmark_group("tunnel_body");
    for size in [150usize, 4 * 1024, 64 * 1024] {
        let body: Vec<u8> = (0..size).map(|i| b"data: {}\n"[i % 9]).collect();
        group.throughput(Throughput::Bytes((size * FRAMES) as u64));
        let plain: Vec<_> = (0..FRAMES)
            .map(|_| PlainTunnelFrame::Body(body.clone()))
            .collect();
        let ours: Vec<_> = (0..FRAMES)
            .map(|_| ProviderTunnelFrame::Body(body.clone()))
            .collect();
        let mut wire = Vec::new();
        group.bench_with_input(BenchmarkId::new("plain_vec", size), &plain, |b, frames| {
            b.iter(|| round_trip(frames, &mut wire));
        });
        group.bench_with_input(BenchmarkId::new("byte_string", size), &ours, |b, frames| {
            b.iter(|| round_trip(frames, &mut wire));
        });
    }
    group.finish();
}

criterion_group!(benches, tunnel_body);
criterion_main!(benches);
