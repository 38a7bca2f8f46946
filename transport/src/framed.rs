//! Typed message I/O on quinn streams: length-prefixed postcard frames
//! (SPEC §3).
//!
//! A frame the peer got wrong (oversize, undecodable, cut short) is a
//! protocol error that ends *that stream*: [`FramedRecv::recv`] returns
//! [`FramedError::PeerProtocol`] and stops the stream with the matching
//! [`StreamErrorCode`], so the sender sees STOP with that code. Other
//! streams on the connection are untouched.

use iop_wire::{
    CloseCode, EDGE_FRAME_MAX_LEN, FrameDecoder, MAX_FRAME_LEN, NODE_FRAME_MAX_LEN,
    StreamErrorCode, WireError,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::close::close_code_of;

/// The most bytes taken from quinn per read: bounds one read's copy into
/// the decoder, whatever the peer sends.
const READ_CHUNK_MAX: usize = 64 * 1024;

/// Why a framed send or receive failed, by who is at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FramedError {
    /// The peer sent bytes that are not a valid frame. This side stopped
    /// the stream with `code` (peer's fault).
    #[error("peer protocol error, stream stopped with {code}: {error}")]
    PeerProtocol {
        /// What was wrong with the bytes.
        error: WireError,
        /// The code the stream was stopped with.
        code: StreamErrorCode,
    },
    /// The peer reset the stream we were reading (it abandoned sending).
    #[error("stream reset by peer with {}", describe_code(*code, *raw_code))]
    ResetByPeer {
        /// The code, if it is one iop knows.
        code: Option<StreamErrorCode>,
        /// The raw QUIC application error code.
        raw_code: u64,
    },
    /// The peer stopped the stream we were writing (it will read no more).
    #[error("stream stopped by peer with {}", describe_code(*code, *raw_code))]
    StoppedByPeer {
        /// The code, if it is one iop knows.
        code: Option<StreamErrorCode>,
        /// The raw QUIC application error code.
        raw_code: u64,
    },
    /// The whole connection is gone (closed by either side, timed out,
    /// reset).
    #[error("connection lost{}: {source}", close_code.map(|c| format!(" ({c})")).unwrap_or_default())]
    ConnectionLost {
        /// The application close code, when the peer closed with a known
        /// one.
        close_code: Option<CloseCode>,
        /// What quinn reported.
        source: quinn::ConnectionError,
    },
    /// A message could not be encoded, or is larger than the frame maximum
    /// (our fault; nothing was sent).
    #[error("cannot encode message: {0}")]
    Encode(#[source] WireError),
    /// This side used the stream after finishing, resetting or stopping it
    /// (our fault).
    #[error("stream misuse on this side: {what}")]
    LocalMisuse {
        /// What was done wrong.
        what: &'static str,
    },
}

impl FramedError {
    /// True when the peer (or the network) is at fault, false when this
    /// side is.
    pub fn is_peer_fault(&self) -> bool {
        !matches!(
            self,
            FramedError::Encode(_) | FramedError::LocalMisuse { .. }
        )
    }

    fn from_connection(source: quinn::ConnectionError) -> Self {
        FramedError::ConnectionLost {
            close_code: close_code_of(&source),
            source,
        }
    }
}

fn describe_code(code: Option<StreamErrorCode>, raw_code: u64) -> String {
    match code {
        Some(code) => format!("{code} ({raw_code:#x})"),
        None => format!("unknown code {raw_code:#x}"),
    }
}

fn split_code(raw: quinn::VarInt) -> (Option<StreamErrorCode>, u64) {
    let raw = raw.into_inner();
    (StreamErrorCode::from_code(raw), raw)
}

impl From<quinn::WriteError> for FramedError {
    fn from(error: quinn::WriteError) -> Self {
        match error {
            quinn::WriteError::Stopped(raw) => {
                let (code, raw_code) = split_code(raw);
                FramedError::StoppedByPeer { code, raw_code }
            }
            quinn::WriteError::ConnectionLost(source) => FramedError::from_connection(source),
            quinn::WriteError::ClosedStream => FramedError::LocalMisuse {
                what: "write after finish or reset",
            },
            quinn::WriteError::ZeroRttRejected => FramedError::LocalMisuse {
                what: "0-RTT data was rejected (iop does not use 0-RTT)",
            },
        }
    }
}

impl From<quinn::ReadError> for FramedError {
    fn from(error: quinn::ReadError) -> Self {
        match error {
            quinn::ReadError::Reset(raw) => {
                let (code, raw_code) = split_code(raw);
                FramedError::ResetByPeer { code, raw_code }
            }
            quinn::ReadError::ConnectionLost(source) => FramedError::from_connection(source),
            quinn::ReadError::ClosedStream => FramedError::LocalMisuse {
                what: "read after stop",
            },
            quinn::ReadError::IllegalOrderedRead => FramedError::LocalMisuse {
                what: "ordered read after an unordered read",
            },
            quinn::ReadError::ZeroRttRejected => FramedError::LocalMisuse {
                what: "0-RTT data was rejected (iop does not use 0-RTT)",
            },
        }
    }
}

impl From<quinn::ClosedStream> for FramedError {
    fn from(_: quinn::ClosedStream) -> Self {
        FramedError::LocalMisuse {
            what: "stream already finished, reset or stopped",
        }
    }
}

/// The frame limits of one endpoint's streams, per direction (R-LIM-3).
/// The Edge is the QUIC server, the Node the client: a server receives
/// node frames ([`NODE_FRAME_MAX_LEN`], much smaller than a request) and
/// sends edge frames ([`EDGE_FRAME_MAX_LEN`]); a client the other way round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest payload this side sends.
    pub send: usize,
    /// Largest payload this side accepts.
    pub recv: usize,
}

impl FrameLimits {
    /// The limits of the endpoint on `side` of a connection.
    pub fn for_side(side: quinn::Side) -> Self {
        match side {
            quinn::Side::Server => Self {
                send: EDGE_FRAME_MAX_LEN,
                recv: NODE_FRAME_MAX_LEN,
            },
            quinn::Side::Client => Self {
                send: NODE_FRAME_MAX_LEN,
                recv: EDGE_FRAME_MAX_LEN,
            },
        }
    }
}

/// Wrap both halves of a stream on `side`'s end of a connection with that
/// side's per-direction frame limits.
pub fn framed_for_side(
    side: quinn::Side,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
) -> (FramedSend, FramedRecv) {
    let limits = FrameLimits::for_side(side);
    (
        FramedSend::with_max_frame_len(send, limits.send),
        FramedRecv::with_max_frame_len(recv, limits.recv),
    )
}

/// The sending half of a stream, carrying typed messages as frames.
/// How many encoded bytes [`FramedSend::send_all`] gathers before it writes
/// them: ready frames go out together, and a batch of large ones never
/// buffers more than about this plus one frame.
pub const BATCH_WRITE_BYTES: usize = 64 * 1024;

#[derive(Debug)]
pub struct FramedSend {
    stream: quinn::SendStream,
    /// Reused encode buffer.
    buf: Vec<u8>,
    max_frame_len: usize,
}

impl FramedSend {
    /// Wrap `stream`; frames up to [`MAX_FRAME_LEN`] bytes.
    pub fn new(stream: quinn::SendStream) -> Self {
        Self::with_max_frame_len(stream, MAX_FRAME_LEN)
    }

    /// Wrap `stream`, refusing to send frames larger than `max_frame_len`
    /// (capped at [`MAX_FRAME_LEN`]), the limit the peer's decoder enforces.
    pub fn with_max_frame_len(stream: quinn::SendStream, max_frame_len: usize) -> Self {
        Self {
            stream,
            buf: Vec::new(),
            max_frame_len: max_frame_len.min(MAX_FRAME_LEN),
        }
    }

    /// Encode `message` as one frame and write it.
    ///
    /// Not cancel-safe: dropping the future mid-write leaves a partial frame
    /// on the stream; [`Self::reset`] it then.
    pub async fn send<T: Serialize>(&mut self, message: &T) -> Result<(), FramedError> {
        self.buf.clear();
        self.encode(message)?;
        self.stream.write_all(&self.buf).await?;
        Ok(())
    }

    /// Encode `messages` as consecutive frames and write them with as few
    /// stream writes as [`BATCH_WRITE_BYTES`] allows: what is ready goes in
    /// one write, not one per frame. An error ends the call: a frame that
    /// cannot be encoded (too large) is never written, and neither is any
    /// frame after it; frames before it may have been.
    ///
    /// Not cancel-safe, like [`Self::send`].
    pub async fn send_all<'a, T: Serialize + 'a>(
        &mut self,
        messages: impl IntoIterator<Item = &'a T>,
    ) -> Result<(), FramedError> {
        self.buf.clear();
        for message in messages {
            self.encode(message)?;
            if self.buf.len() >= BATCH_WRITE_BYTES {
                self.stream.write_all(&self.buf).await?;
                self.buf.clear();
            }
        }
        if !self.buf.is_empty() {
            self.stream.write_all(&self.buf).await?;
        }
        Ok(())
    }

    /// Append `message` to the buffer as one frame, refused past the
    /// frame limit.
    fn encode<T: Serialize>(&mut self, message: &T) -> Result<(), FramedError> {
        let start = self.buf.len();
        iop_wire::encode_frame_into(message, &mut self.buf).map_err(FramedError::Encode)?;
        let payload_len = (self.buf.len() - start).saturating_sub(4);
        if payload_len > self.max_frame_len {
            self.buf.truncate(start);
            return Err(FramedError::Encode(WireError::FrameTooLarge {
                len: payload_len as u64,
                max: self.max_frame_len,
            }));
        }
        Ok(())
    }

    /// Finish the stream: the peer reads the end after the last frame.
    pub fn finish(&mut self) -> Result<(), FramedError> {
        self.stream.finish()?;
        Ok(())
    }

    /// Abandon the stream with `code`; unsent frames are dropped.
    pub fn reset(&mut self, code: StreamErrorCode) -> Result<(), FramedError> {
        self.stream.reset(code.code().into())?;
        Ok(())
    }

    /// Wait until the peer has received everything (after [`Self::finish`])
    /// or stopped the stream; a stop is [`FramedError::StoppedByPeer`].
    pub async fn stopped(&mut self) -> Result<(), FramedError> {
        match self.stream.stopped().await {
            Ok(None) => Ok(()),
            Ok(Some(raw)) => {
                let (code, raw_code) = split_code(raw);
                Err(FramedError::StoppedByPeer { code, raw_code })
            }
            Err(quinn::StoppedError::ConnectionLost(source)) => {
                Err(FramedError::from_connection(source))
            }
            Err(quinn::StoppedError::ZeroRttRejected) => Err(FramedError::LocalMisuse {
                what: "0-RTT data was rejected (iop does not use 0-RTT)",
            }),
        }
    }

    /// The QUIC stream id.
    pub fn id(&self) -> quinn::StreamId {
        self.stream.id()
    }

    /// The underlying quinn stream.
    pub fn get_mut(&mut self) -> &mut quinn::SendStream {
        &mut self.stream
    }

    /// Unwrap the quinn stream.
    pub fn into_inner(self) -> quinn::SendStream {
        self.stream
    }
}

/// The receiving half of a stream, decoding frames into typed messages.
#[derive(Debug)]
pub struct FramedRecv {
    stream: quinn::RecvStream,
    decoder: FrameDecoder,
    /// The peer finished the stream and every byte was read.
    ended: bool,
    /// This side already stopped the stream.
    stopped: bool,
}

impl FramedRecv {
    /// Wrap `stream`; frames up to [`MAX_FRAME_LEN`] bytes.
    pub fn new(stream: quinn::RecvStream) -> Self {
        Self::with_max_frame_len(stream, MAX_FRAME_LEN)
    }

    /// Wrap `stream`, refusing frames longer than `max_frame_len` (capped at
    /// [`MAX_FRAME_LEN`]).
    pub fn with_max_frame_len(stream: quinn::RecvStream, max_frame_len: usize) -> Self {
        Self {
            stream,
            decoder: FrameDecoder::new(max_frame_len),
            ended: false,
            stopped: false,
        }
    }

    /// The next message, or `None` once the peer finished the stream
    /// cleanly after a whole frame.
    ///
    /// An oversize, undecodable or truncated frame stops the stream with
    /// the matching [`StreamErrorCode`] and returns
    /// [`FramedError::PeerProtocol`]; every later call returns the same
    /// error. Cancel-safe: bytes read are kept in the decoder, so it can
    /// sit in a `select!`.
    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<Option<T>, FramedError> {
        loop {
            match self.decoder.next_message::<T>() {
                Ok(Some(message)) => return Ok(Some(message)),
                Ok(None) => {}
                Err(error) => return Err(self.protocol_error(error)),
            }
            if self.ended {
                return match self.decoder.finish() {
                    Ok(()) => Ok(None),
                    Err(error) => Err(self.protocol_error(error)),
                };
            }
            match self.stream.read_chunk(READ_CHUNK_MAX, true).await? {
                Some(chunk) => {
                    if let Err(error) = self.decoder.push(&chunk.bytes) {
                        return Err(self.protocol_error(error));
                    }
                }
                None => self.ended = true,
            }
        }
    }

    /// Stop the stream with `code`: the peer's writes fail with it. Use
    /// [`StreamErrorCode::UnexpectedMessage`] for a well-formed frame the
    /// stream does not carry.
    pub fn stop(&mut self, code: StreamErrorCode) -> Result<(), FramedError> {
        self.stopped = true;
        self.stream.stop(code.code().into())?;
        Ok(())
    }

    /// The QUIC stream id.
    pub fn id(&self) -> quinn::StreamId {
        self.stream.id()
    }

    /// Unwrap the quinn stream. Bytes already read into the decoder are
    /// lost.
    pub fn into_inner(self) -> quinn::RecvStream {
        self.stream
    }

    fn protocol_error(&mut self, error: WireError) -> FramedError {
        let code = error.stream_error_code();
        if !self.stopped {
            self.stopped = true;
            // A stream the peer already finished cannot be stopped any more;
            // the typed error below is all that is left to report.
            if self.stream.stop(code.code().into()).is_err() {
                tracing::debug!(%code, "stream already closed; not stopped");
            }
        }
        FramedError::PeerProtocol { error, code }
    }
}

/// Open a bidirectional stream on `conn` as framed halves, with this side's
/// frame limits ([`FrameLimits::for_side`]). The peer learns of the stream
/// only when the first frame is sent.
pub async fn open_framed(
    conn: &quinn::Connection,
) -> Result<(FramedSend, FramedRecv), FramedError> {
    let (send, recv) = conn.open_bi().await.map_err(FramedError::from_connection)?;
    Ok(framed_for_side(conn.side(), send, recv))
}

/// Accept the peer's next bidirectional stream on `conn` as framed halves,
/// with this side's frame limits ([`FrameLimits::for_side`]).
pub async fn accept_framed(
    conn: &quinn::Connection,
) -> Result<(FramedSend, FramedRecv), FramedError> {
    let (send, recv) = conn
        .accept_bi()
        .await
        .map_err(FramedError::from_connection)?;
    Ok(framed_for_side(conn.side(), send, recv))
}
