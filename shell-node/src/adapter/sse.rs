//! Server-Sent Events from a provider (the WHATWG event-stream format).
//!
//! [`SseDecoder`] turns the bytes of a provider's answer into the `data` of
//! each event, borrowed from its own buffer: decoding a one-line event
//! copies nothing and allocates nothing. It puts a bound on how much a
//! provider may send before an event completes ([`MAX_EVENT_BYTES`]), so a
//! misbehaving server cannot grow our buffers without limit. Text is not
//! checked here: the JSON parser that reads each event validates its UTF-8.

use std::ops::Range;

/// The largest accepted event (bytes between blank lines).
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// UTF-8 byte-order mark, skipped at the start of a stream.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// An event grew past [`MAX_EVENT_BYTES`] without ending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("event larger than {MAX_EVENT_BYTES} bytes")]
pub(crate) struct EventTooLarge;

/// Where the data of the event being read is.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum EventData {
    /// No `data` line yet.
    #[default]
    None,
    /// One `data` line, still in the decoder's byte buffer.
    InBuffer(Range<usize>),
    /// Several lines (or one that had to outlive a buffer compaction),
    /// joined by `\n` in the decoder's `joined` buffer.
    Joined,
}

/// Incremental SSE decoder: feed bytes with [`SseDecoder::push`], take the
/// `data` of each complete event with [`SseDecoder::next_data`].
///
/// Lines end in `\n`, `\r\n` or `\r` (a pair may be split across pushes);
/// lines starting with `:` are comments; a `data` field's value is the text
/// after `data:` minus one leading space; several `data` lines join with
/// `\n`; a blank line ends the event, which is dispatched only if it had a
/// `data` line. Other fields (`event`, `id`, `retry`) are read and ignored.
/// An unterminated event at the end of the stream is not dispatched.
#[derive(Debug, Default)]
pub(crate) struct SseDecoder {
    /// Bytes received; `buf[pos..]` is not consumed yet.
    buf: Vec<u8>,
    pos: usize,
    /// The last line ended in `\r`: a `\n` next is the rest of that end.
    skip_lf: bool,
    /// The first line (and any byte-order mark before it) was read.
    past_bom: bool,
    /// Bytes of the current event's complete lines (terminators included).
    event_bytes: usize,
    data: EventData,
    joined: Vec<u8>,
    /// The last call returned an event: its data is cleared on the next call.
    dispatched: bool,
}

impl SseDecoder {
    /// Append received bytes.
    pub(crate) fn push(&mut self, chunk: &[u8]) {
        self.settle();
        if self.pos > 0 {
            // Keep only the unread tail; a data line pointing into the
            // consumed part moves to `joined` first.
            if let EventData::InBuffer(range) = &self.data {
                self.joined.clear();
                self.joined.extend_from_slice(&self.buf[range.clone()]);
                self.data = EventData::Joined;
            }
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// The data of the next complete event, or `None` until more bytes
    /// arrive. The data is borrowed until the next call.
    pub(crate) fn next_data(&mut self) -> Result<Option<&[u8]>, EventTooLarge> {
        self.settle();
        loop {
            if self.skip_lf && self.pos < self.buf.len() {
                self.skip_lf = false;
                if self.buf[self.pos] == b'\n' {
                    self.pos += 1;
                    self.event_bytes += 1;
                }
            }
            let rest = &self.buf[self.pos..];
            let Some(len) = memchr::memchr2(b'\n', b'\r', rest) else {
                if self.event_bytes + rest.len() > MAX_EVENT_BYTES {
                    return Err(EventTooLarge);
                }
                return Ok(None);
            };
            let mut line = self.pos..self.pos + len;
            self.skip_lf = rest[len] == b'\r';
            self.pos += len + 1;
            self.event_bytes += len + 1;
            if self.event_bytes > MAX_EVENT_BYTES {
                return Err(EventTooLarge);
            }
            if !self.past_bom {
                self.past_bom = true;
                if self.buf[line.clone()].starts_with(BOM) {
                    line.start += BOM.len();
                }
            }
            if line.is_empty() {
                self.event_bytes = 0;
                if self.data == EventData::None {
                    continue;
                }
                self.dispatched = true;
                return Ok(Some(match &self.data {
                    EventData::InBuffer(range) => &self.buf[range.clone()],
                    _ => &self.joined,
                }));
            }
            self.field(line);
        }
    }

    /// Read one non-empty line: a comment or a field.
    fn field(&mut self, line: Range<usize>) {
        let text = &self.buf[line.clone()];
        let (name, value) = match memchr::memchr(b':', text) {
            Some(0) => return, // a comment
            Some(colon) => {
                let start = line.start + colon + 1;
                let start = if self.buf.get(start) == Some(&b' ') && start < line.end {
                    start + 1
                } else {
                    start
                };
                (&text[..colon], start..line.end)
            }
            None => (text, line.end..line.end),
        };
        if name != b"data" {
            return;
        }
        match &self.data {
            EventData::None => self.data = EventData::InBuffer(value),
            EventData::InBuffer(first) => {
                self.joined.clear();
                self.joined.extend_from_slice(&self.buf[first.clone()]);
                self.joined.push(b'\n');
                self.joined.extend_from_slice(&self.buf[value]);
                self.data = EventData::Joined;
            }
            EventData::Joined => {
                self.joined.push(b'\n');
                self.joined.extend_from_slice(&self.buf[value]);
            }
        }
    }

    /// Forget the event returned by the last call.
    fn settle(&mut self) {
        if self.dispatched {
            self.dispatched = false;
            self.data = EventData::None;
            self.joined.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event's data from `chunks` pushed one by one.
    fn decode(chunks: &[&[u8]]) -> Result<Vec<String>, EventTooLarge> {
        let mut decoder = SseDecoder::default();
        let mut out = Vec::new();
        for chunk in chunks {
            decoder.push(chunk);
            while let Some(data) = decoder.next_data()? {
                out.push(String::from_utf8(data.to_vec()).expect("UTF-8"));
            }
        }
        Ok(out)
    }

    #[test]
    fn events_decode_the_same_however_the_bytes_are_split() {
        let whole: &[u8] = b"\xEF\xBB\xBFdata: a\n\n: comment\nevent: x\ndata: b\ndata:c\r\n\r\n\
            id: 7\ndata\n\ndata:  two spaces\rretry: 5\r\rdata: [DONE]\n\n";
        let one = decode(&[whole]).unwrap();
        assert_eq!(one, vec!["a", "b\nc", "", " two spaces", "[DONE]"]);
        for size in 1..whole.len() {
            let split: Vec<&[u8]> = whole.chunks(size).collect();
            assert_eq!(decode(&split).unwrap(), one, "chunks of {size}");
        }
    }

    #[test]
    fn a_blank_line_without_data_and_an_unterminated_event_dispatch_nothing() {
        assert_eq!(
            decode(&[b"event: ping\n\n\n: keep\n\ndata: cut"]).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_crlf_split_across_pushes_is_one_line_end() {
        assert_eq!(
            decode(&[b"data: a\r", b"\n\r", b"\ndata: b\r\r"]).unwrap(),
            vec!["a", "b"]
        );
    }

    #[test]
    fn only_a_leading_byte_order_mark_is_skipped() {
        assert_eq!(
            decode(&[b"data: x\n\n\xEF\xBB\xBFdata: y\n\n"]).unwrap(),
            vec!["x"]
        );
    }

    #[test]
    fn an_event_is_taken_up_to_the_bound_and_cut_past_it() {
        // MAX_EVENT_BYTES bytes, line ends included: read.
        let mut at_bound = b"data: ".to_vec();
        at_bound.resize(MAX_EVENT_BYTES - 2, b'x');
        at_bound.extend_from_slice(b"\n\n");
        assert_eq!(
            decode(&[&at_bound]).unwrap()[0].len(),
            MAX_EVENT_BYTES - 2 - 6
        );
        // One byte more: cut, whether the event ends or not yet.
        let mut past = b"data: ".to_vec();
        past.resize(MAX_EVENT_BYTES - 1, b'x');
        past.extend_from_slice(b"\n\n");
        assert_eq!(decode(&[&past]), Err(EventTooLarge));
        let open = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(decode(&[&open[..MAX_EVENT_BYTES]]), Ok(Vec::new()));
        assert_eq!(decode(&[&open[..10], &open[10..]]), Err(EventTooLarge));
    }
}
