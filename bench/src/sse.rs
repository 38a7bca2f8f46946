//! A minimal incremental scanner for Chat Completions SSE streams: it splits
//! events at blank lines and classifies each `data:` event without parsing
//! its JSON (the load generator must stay cheaper than what it measures).

/// The longest event kept while waiting for its end; beyond it the stream
/// is declared malformed.
pub const MAX_EVENT_BYTES: usize = 1024 * 1024;

/// What one SSE event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SseEvent {
    /// A chunk carrying non-empty `delta.content` (the first one is TTFT).
    Content,
    /// Any other data chunk (role, finish reason, usage, tool call).
    Other,
    /// `data: [DONE]`: the stream ended normally.
    Done,
    /// An in-stream error event (`data: {"error":...}`).
    Error,
}

/// Why a stream could not be scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event grew past [`MAX_EVENT_BYTES`] without ending.
    #[error("an SSE event exceeded {MAX_EVENT_BYTES} bytes")]
    EventTooLong,
}

/// Splits a byte stream into SSE events.
#[derive(Debug, Default)]
pub struct SseScanner {
    partial: Vec<u8>,
}

impl SseScanner {
    /// A scanner at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed the next bytes; `on_event` sees every event completed by them,
    /// in order. Comments and events without `data:` are skipped.
    pub fn feed(
        &mut self,
        bytes: &[u8],
        mut on_event: impl FnMut(SseEvent),
    ) -> Result<(), SseError> {
        self.partial.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(end) = find_blank_line(&self.partial[start..]) {
            if let Some(event) = classify(&self.partial[start..start + end]) {
                on_event(event);
            }
            start += end + 2;
        }
        self.partial.drain(..start);
        if self.partial.len() > MAX_EVENT_BYTES {
            return Err(SseError::EventTooLong);
        }
        Ok(())
    }
}

/// Offset of the first `\n\n` in `bytes`.
fn find_blank_line(bytes: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = bytes[from..].iter().position(|b| *b == b'\n') {
        let at = from + i;
        if bytes.get(at + 1) == Some(&b'\n') {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

const CONTENT_KEY: &[u8] = b"\"content\":\"";

fn classify(event: &[u8]) -> Option<SseEvent> {
    // The data line may follow an `event:` line.
    let data_at = if event.starts_with(b"data:") {
        0
    } else {
        event.windows(6).position(|w| w == b"\ndata:")? + 1
    };
    let data = event[data_at + 5..].trim_ascii_start();
    if data.starts_with(b"[DONE]") {
        return Some(SseEvent::Done);
    }
    if data.starts_with(b"{\"error\"") {
        return Some(SseEvent::Error);
    }
    let content = data
        .windows(CONTENT_KEY.len())
        .position(|w| w == CONTENT_KEY)
        .is_some_and(|i| data.get(i + CONTENT_KEY.len()) != Some(&b'"'));
    Some(if content {
        SseEvent::Content
    } else {
        SseEvent::Other
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(pieces: &[&[u8]]) -> Vec<SseEvent> {
        let mut s = SseScanner::new();
        let mut out = Vec::new();
        for p in pieces {
            s.feed(p, |e| out.push(e)).unwrap();
        }
        out
    }

    #[test]
    fn events_split_across_reads_are_classified_once_each() {
        let stream: &[u8] =
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"tok0\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        let whole = scan(&[stream]);
        assert_eq!(
            whole,
            vec![
                SseEvent::Other,
                SseEvent::Content,
                SseEvent::Other,
                SseEvent::Done
            ]
        );
        for cut in 1..stream.len() {
            assert_eq!(
                scan(&[&stream[..cut], &stream[cut..]]),
                whole,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn error_events_and_named_events_are_recognised() {
        let out = scan(&[b": comment\n\ndata: {\"error\":{\"message\":\"x\"}}\n\nevent: e\ndata: {\"content\":\"a\"}\n\n"]);
        assert_eq!(out, vec![SseEvent::Error, SseEvent::Content]);
    }

    #[test]
    fn an_event_that_never_ends_is_refused_at_the_bound() {
        let mut s = SseScanner::new();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(s.feed(&big, |_| {}), Err(SseError::EventTooLong));
    }
}
