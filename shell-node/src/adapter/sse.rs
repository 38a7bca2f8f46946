//! Server-Sent Events from a provider: framing is the `eventsource-stream`
//! crate's (the WHATWG event-stream format); this module only puts a bound
//! on how much a provider may send before an event completes, so a
//! misbehaving server cannot grow our buffers without limit.

use bytes::Bytes;
use futures::Stream;
use futures::StreamExt;

/// The largest accepted event (bytes between blank lines).
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// Why the byte stream was cut.
#[derive(Debug, thiserror::Error)]
pub enum SseGuardError {
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] reqwest::Error),
    /// An event exceeded [`MAX_EVENT_BYTES`].
    #[error("event larger than {MAX_EVENT_BYTES} bytes")]
    EventTooLarge,
}

/// Pass `bytes` through, failing once more than [`MAX_EVENT_BYTES`] arrive
/// without an event boundary (a blank line). Only counts; never frames.
pub fn bounded(
    bytes: impl Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static,
) -> impl Stream<Item = Result<Bytes, SseGuardError>> + Send + 'static {
    // (bytes since the last blank line, the last byte seen, a `\r` before it)
    let mut since_boundary = 0usize;
    let mut prev: [u8; 2] = [0, 0];
    bytes.map(move |chunk| {
        let chunk = chunk?;
        for &b in chunk.iter() {
            since_boundary += 1;
            // "\n\n" or "\r\n\r\n" (the "\r\n" pair is seen as its "\n").
            let blank = b == b'\n' && (prev[1] == b'\n' || (prev[1] == b'\r' && prev[0] == b'\n'));
            if blank {
                since_boundary = 0;
            }
            prev = [prev[1], b];
        }
        if since_boundary > MAX_EVENT_BYTES {
            return Err(SseGuardError::EventTooLarge);
        }
        Ok(chunk)
    })
}

#[cfg(test)]
mod tests {
    use eventsource_stream::Eventsource;
    use futures::StreamExt;

    use super::*;

    async fn events(chunks: Vec<&'static [u8]>) -> Vec<(String, String)> {
        let stream = futures::stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from_static(c))));
        bounded(stream)
            .eventsource()
            .filter_map(|e| async move { e.ok().map(|e| (e.event, e.data)) })
            .collect()
            .await
    }

    #[tokio::test]
    async fn events_decode_the_same_however_the_bytes_are_split() {
        let whole: &[u8] =
            b"data: a\n\n: comment\nevent: x\ndata: b\ndata: c\r\n\r\ndata: [DONE]\n\n";
        let one = events(vec![whole]).await;
        let split: Vec<&'static [u8]> = whole.chunks(3).collect();
        assert_eq!(events(split).await, one);
        assert_eq!(one[0].1, "a");
        assert_eq!(one[1], ("x".to_owned(), "b\nc".to_owned()));
        assert_eq!(one[2].1, "[DONE]");
    }

    #[tokio::test]
    async fn an_event_without_end_is_cut_at_the_bound() {
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        let stream = futures::stream::iter(vec![Ok::<_, reqwest::Error>(Bytes::from(big))]);
        let out: Vec<_> = bounded(stream).collect().await;
        assert!(matches!(out[0], Err(SseGuardError::EventTooLarge)));
    }
}
