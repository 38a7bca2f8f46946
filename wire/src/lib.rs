//! # iop-wire: the Edge <-> Node protocol
//!
//! Every message that crosses a QUIC stream between an Edge and a Node, the
//! postcard codec that turns them into bytes, and the length-prefixed framing
//! that carries them. This crate does no I/O: it turns values into bytes and
//! bytes (arriving split at any point) back into values, and refuses anything
//! malformed or oversize with a typed [`WireError`].
//!
//! ## Stream layout (SPEC §3)
//!
//! * ALPN [`ALPN`] (`iop/1`). The Node is the QUIC client, the Edge the server.
//! * **Control stream**, opened by the Node: the Node sends [`NodeControl`]
//!   frames, the Edge answers with [`EdgeControl`] frames. Registration,
//!   readiness, heartbeats, config refresh and cancels travel here.
//! * **One bidirectional data stream per unit of work**, opened by the Edge:
//!   its first frame is a [`DataRequest`] (a run, a tunnel or a command); the
//!   Node answers with [`RunEvent`]s, [`ProviderTunnelFrame`]s or
//!   [`CommandResult`]s, ending in exactly one terminal.
//!
//! Each frame is a big-endian `u32` length followed by that many bytes of
//! postcard. [`FrameDecoder`] checks the length against its maximum before it
//! reserves a single byte.

#![deny(missing_docs)]

mod bounded;
mod codec;
mod messages;

pub use codec::{FrameDecoder, WireError, decode, encode_frame, encode_frame_into};
pub use messages::*;

/// The ALPN protocol id both endpoints must negotiate.
pub const ALPN: &[u8] = b"iop/1";

/// The protocol version a Node announces in its [`RegisterRequest`]
/// (7: [`Usage`] carries the provider's prompt-cache counts, chat messages
/// and tools their prompt-cache breakpoints; 8: chat messages carry
/// [`Document`]s, [`GenerationParams`] the Messages API's beta features).
pub const PROTOCOL_VERSION: u32 = 8;

/// The hard maximum length of one frame's payload, in bytes (16 MiB).
///
/// A prompt with a very long context fits; anything larger is a protocol
/// error that closes the stream.
pub const MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// The maximum payload of a frame a Node sends to the Edge (4 MiB + 64
/// KiB), much smaller than [`MAX_FRAME_LEN`] (R-LIM-3): what a node sends
/// is a provider's output, relayed in pieces (one SSE event of at most
/// 4 MiB, tunnel body chunks of 64 KiB), never a client's whole prompt.
pub const NODE_FRAME_MAX_LEN: usize = 4 * 1024 * 1024 + 64 * 1024;

/// The maximum payload of a frame the Edge sends to a Node: a request
/// carries the client's whole body.
pub const EDGE_FRAME_MAX_LEN: usize = MAX_FRAME_LEN;

/// Most headers in one tunnelled request or response head (R-LIM-3).
pub const MAX_HEADERS: usize = 128;

/// Most bytes of one header, name plus value (R-LIM-3).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Most models one target may list (registration, capabilities) (R-LIM-3).
pub const MAX_MODELS_PER_TARGET: usize = 4096;

/// Most bytes of one model name (R-LIM-3).
pub const MAX_MODEL_NAME_BYTES: usize = 1024;

/// Most providers a Node may offer at registration (R-LIM-3).
pub const MAX_OFFERED_PROVIDERS: usize = 256;

/// Most parked runs one registration reports (R-LIM-3).
pub const MAX_PARKED_RUNS: usize = 4096;

/// Most bytes of a response id (R-LIM-3).
pub const MAX_RESPONSE_ID_BYTES: usize = 128;

/// Most bytes of a target name in a parked-run report (R-LIM-3).
pub const MAX_TARGET_BYTES: usize = 1024;

/// The park grace a [`ParkSpec`] with `grace_ms = 0` means (R-PARK-1).
pub const DEFAULT_PARK_GRACE_MS: u64 = 30_000;

/// Most targets in one capabilities report (R-LIM-3).
pub const MAX_CAPABILITY_TARGETS: usize = 256;

/// Wire value `0` for `response_stall_timeout_ms`: use this default (R-WD).
pub const DEFAULT_RESPONSE_STALL_TIMEOUT_MS: u64 = 300_000;

/// Smallest non-zero `response_stall_timeout_ms` a Node accepts.
pub const MIN_RESPONSE_STALL_TIMEOUT_MS: u64 = 100;

/// Largest `response_stall_timeout_ms` a Node accepts (one hour).
pub const MAX_RESPONSE_STALL_TIMEOUT_MS: u64 = 3_600_000;

pub mod fuzzing;

#[cfg(test)]
mod tests;

/// Ollama's generation `options`: a pass-through request field of one of
/// these names goes into `options` for an Ollama provider (the Node maps
/// it; the Edge decides the provider can take the request).
pub const OLLAMA_OPTIONS: &[&str] = &[
    "num_keep",
    "seed",
    "num_predict",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repeat_last_n",
    "temperature",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "penalize_newline",
    "stop",
    "numa",
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "use_mmap",
    "num_thread",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "tfs_z",
];
