//! An incremental Server-Sent Events decoder (the WHATWG event-stream
//! format): `data:` lines are joined, `event:` names the event, comments and
//! other fields are ignored, a blank line dispatches. Bounded per event.

use super::lines::{LineBuffer, LineError};

/// The largest accepted event payload.
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The joined `data:` lines.
    pub data: String,
}

/// Why the event stream could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A line was too long or not UTF-8.
    #[error(transparent)]
    Line(#[from] LineError),
    /// An event exceeded [`MAX_EVENT_BYTES`].
    #[error("event larger than {MAX_EVENT_BYTES} bytes")]
    EventTooLarge,
}

/// Decodes a byte stream into [`SseEvent`]s.
#[derive(Debug, Default)]
pub struct SseDecoder {
    lines: LineBuffer,
    event: Option<String>,
    data: String,
    has_data: bool,
}

impl SseDecoder {
    /// Feed a chunk; returns the events it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut out = Vec::new();
        for line in self.lines.push(chunk)? {
            if let Some(event) = self.line(&line)? {
                out.push(event);
            }
        }
        Ok(out)
    }

    /// End of stream: a last event without its blank line is still
    /// dispatched (servers that close right after `data: [DONE]` exist).
    pub fn finish(&mut self) -> Result<Option<SseEvent>, SseError> {
        if let Some(line) = self.lines.finish()?
            && let Some(event) = self.line(&line)?
        {
            return Ok(Some(event));
        }
        Ok(self.dispatch())
    }

    fn line(&mut self, line: &str) -> Result<Option<SseEvent>, SseError> {
        if line.is_empty() {
            return Ok(self.dispatch());
        }
        if line.starts_with(':') {
            return Ok(None);
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.data.len() + value.len() + 1 > MAX_EVENT_BYTES {
                    return Err(SseError::EventTooLarge);
                }
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_owned()),
            _ => {}
        }
        Ok(None)
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let event = self.event.take();
        if !self.has_data {
            return None;
        }
        self.has_data = false;
        Some(SseEvent {
            event,
            data: std::mem::take(&mut self.data),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_in_pieces(input: &[u8], piece: usize) -> Vec<SseEvent> {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        for c in input.chunks(piece) {
            out.extend(d.push(c).unwrap());
        }
        out.extend(d.finish().unwrap());
        out
    }

    #[test]
    fn events_decode_the_same_whatever_the_chunking() {
        let input =
            b": comment\r\nevent: delta\r\ndata: {\"a\":\r\ndata:1}\r\n\r\ndata: [DONE]\n\n";
        let want = vec![
            SseEvent {
                event: Some("delta".into()),
                data: "{\"a\":\n1}".into(),
            },
            SseEvent {
                event: None,
                data: "[DONE]".into(),
            },
        ];
        for piece in 1..input.len() {
            assert_eq!(decode_in_pieces(input, piece), want, "piece {piece}");
        }
    }

    #[test]
    fn a_last_event_without_its_blank_line_is_dispatched_at_the_end() {
        assert_eq!(
            decode_in_pieces(b"data: [DONE]", 4),
            vec![SseEvent {
                event: None,
                data: "[DONE]".into()
            }]
        );
    }

    #[test]
    fn blank_lines_without_data_dispatch_nothing() {
        assert!(decode_in_pieces(b"\n\nevent: x\n\nid: 3\n\n", 3).is_empty());
    }
}
