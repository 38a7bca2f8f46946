//! postcard encoding and length-prefixed framing.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::MAX_FRAME_LEN;

/// Length of the frame header: a big-endian `u32` payload length.
const HEADER_LEN: usize = 4;

/// Why bytes could not become a message. Every variant is the peer's fault
/// except [`WireError::Encode`], which is ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The length prefix announced more than the decoder's maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// The announced payload length.
        len: u64,
        /// The maximum this decoder accepts.
        max: usize,
    },
    /// The payload was not a valid postcard encoding of the expected message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The payload decoded but left bytes unread.
    #[error("{0} trailing bytes after message")]
    TrailingBytes(usize),
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame ({buffered} bytes buffered)")]
    Truncated {
        /// Bytes that were buffered when the stream ended.
        buffered: usize,
    },
    /// A message could not be encoded (a local bug, never the peer's fault).
    #[error("encode failed: {0}")]
    Encode(String),
}

impl WireError {
    /// The stream error code a shell closes the stream with.
    pub fn stream_error_code(&self) -> crate::StreamErrorCode {
        match self {
            WireError::FrameTooLarge { .. } => crate::StreamErrorCode::FrameTooLarge,
            WireError::Truncated { .. } => crate::StreamErrorCode::Truncated,
            WireError::Malformed(_) | WireError::TrailingBytes(_) => {
                crate::StreamErrorCode::Malformed
            }
            WireError::Encode(_) => crate::StreamErrorCode::Internal,
        }
    }
}

/// Decode one whole payload (without its length prefix) into a message.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, WireError> {
    let (value, rest) =
        postcard::take_from_bytes::<T>(payload).map_err(|e| WireError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

/// Encode a message as one frame: length prefix followed by postcard.
pub fn encode_frame<T: Serialize>(message: &T) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(64);
    encode_frame_into(message, &mut out)?;
    Ok(out)
}

/// Append one frame for `message` to `out`.
pub fn encode_frame_into<T: Serialize>(message: &T, out: &mut Vec<u8>) -> Result<(), WireError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    let extended = postcard::to_extend(message, std::mem::take(out));
    *out = extended.map_err(|e| WireError::Encode(e.to_string()))?;
    let len = out.len() - start - HEADER_LEN;
    if len > MAX_FRAME_LEN {
        out.truncate(start);
        return Err(WireError::Encode(format!(
            "message of {len} bytes exceeds the frame maximum of {MAX_FRAME_LEN}"
        )));
    }
    // The check above bounds len to MAX_FRAME_LEN, which fits in u32.
    let len = u32::try_from(len).map_err(|_| WireError::Encode("length overflow".into()))?;
    out[start..start + HEADER_LEN].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// An incremental frame decoder: push bytes as they arrive, split anywhere,
/// and take whole frame payloads out.
///
/// After an error the decoder is poisoned: the stream is broken and every
/// later call returns the same error.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Read position inside `buf`; bytes before it are consumed.
    pos: usize,
    max_frame_len: usize,
    error: Option<WireError>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(MAX_FRAME_LEN)
    }
}

impl FrameDecoder {
    /// A decoder that refuses frames longer than `max_frame_len` bytes.
    pub fn new(max_frame_len: usize) -> Self {
        Self {
            buf: Vec::new(),
            pos: 0,
            max_frame_len: max_frame_len.min(MAX_FRAME_LEN),
            error: None,
        }
    }

    /// Bytes buffered but not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Append received bytes. Nothing is decoded until [`Self::next_frame`].
    ///
    /// Refuses to buffer past one maximal frame plus its header: a peer that
    /// streams bytes faster than they are taken out cannot grow this buffer
    /// without bound.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), WireError> {
        if let Some(err) = &self.error {
            return Err(err.clone());
        }
        self.compact();
        // Check the header as soon as it is complete, before growing.
        self.buf.extend_from_slice(bytes);
        if let Some(len) = self.peek_len()
            && len > self.max_frame_len as u64
        {
            let err = WireError::FrameTooLarge {
                len,
                max: self.max_frame_len,
            };
            self.buf = Vec::new();
            self.pos = 0;
            self.error = Some(err.clone());
            return Err(err);
        }
        Ok(())
    }

    /// Take the next whole frame's payload, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, WireError> {
        Ok(self
            .next_frame_range()?
            .map(|payload| self.buf[payload].to_vec()))
    }

    /// Take and decode the next whole frame as a `T`, straight from the
    /// buffer (no copy of the payload).
    pub fn next_message<T: DeserializeOwned>(&mut self) -> Result<Option<T>, WireError> {
        match self.next_frame_range()? {
            None => Ok(None),
            Some(payload) => decode(&self.buf[payload]).map(Some).inspect_err(|e| {
                self.error = Some(e.clone());
            }),
        }
    }

    /// Where in `buf` the next whole frame's payload is, if one is
    /// buffered; it counts as taken.
    fn next_frame_range(&mut self) -> Result<Option<std::ops::Range<usize>>, WireError> {
        if let Some(err) = &self.error {
            return Err(err.clone());
        }
        let Some(len) = self.peek_len() else {
            return Ok(None);
        };
        if len > self.max_frame_len as u64 {
            let err = WireError::FrameTooLarge {
                len,
                max: self.max_frame_len,
            };
            self.error = Some(err.clone());
            return Err(err);
        }
        // len <= max_frame_len <= MAX_FRAME_LEN, so it fits in usize.
        let len = len as usize;
        let start = self.pos + HEADER_LEN;
        if self.buf.len() - start < len {
            return Ok(None);
        }
        self.pos = start + len;
        Ok(Some(start..start + len))
    }

    /// Call when the stream ended: an error if a frame was left half-read.
    pub fn finish(&self) -> Result<(), WireError> {
        if let Some(err) = &self.error {
            return Err(err.clone());
        }
        match self.buffered() {
            0 => Ok(()),
            buffered => Err(WireError::Truncated { buffered }),
        }
    }

    fn peek_len(&self) -> Option<u64> {
        let header = self.buf.get(self.pos..self.pos + HEADER_LEN)?;
        let mut len = [0u8; HEADER_LEN];
        len.copy_from_slice(header);
        Some(u64::from(u32::from_be_bytes(len)))
    }

    fn compact(&mut self) {
        if self.pos > 0 && (self.pos == self.buf.len() || self.pos > 64 * 1024) {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
    }
}
