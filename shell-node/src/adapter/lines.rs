//! Incremental, bounded line splitting over a byte stream (NDJSON and the
//! line layer of SSE). A line may be split across any number of chunks, and
//! a `\r\n` pair across two.

/// The longest line accepted; a provider that sends more is malformed.
pub const MAX_LINE_BYTES: usize = 1024 * 1024;

/// Why a line could not be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// A line exceeded [`MAX_LINE_BYTES`].
    #[error("line longer than {MAX_LINE_BYTES} bytes")]
    TooLong,
    /// A line was not UTF-8.
    #[error("line is not UTF-8")]
    NotUtf8,
}

/// Splits bytes into lines ended by `\n`, `\r\n` or `\r`.
#[derive(Debug, Default)]
pub struct LineBuffer {
    partial: Vec<u8>,
    /// The previous chunk ended in `\r`: a leading `\n` belongs to it.
    skip_lf: bool,
}

impl LineBuffer {
    /// Feed a chunk; returns every line it completed (without terminators).
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<String>, LineError> {
        let mut lines = Vec::new();
        for &b in chunk {
            match b {
                b'\n' if self.skip_lf => self.skip_lf = false,
                b'\n' => lines.push(self.take()?),
                b'\r' => {
                    lines.push(self.take()?);
                    self.skip_lf = true;
                }
                _ => {
                    self.skip_lf = false;
                    if self.partial.len() >= MAX_LINE_BYTES {
                        return Err(LineError::TooLong);
                    }
                    self.partial.push(b);
                }
            }
        }
        Ok(lines)
    }

    /// The unterminated last line at end of stream, if any.
    pub fn finish(&mut self) -> Result<Option<String>, LineError> {
        if self.partial.is_empty() {
            return Ok(None);
        }
        self.take().map(Some)
    }

    fn take(&mut self) -> Result<String, LineError> {
        self.skip_lf = false;
        String::from_utf8(std::mem::take(&mut self.partial)).map_err(|_| LineError::NotUtf8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_chunks_and_crlf_pairs_are_joined() {
        let mut b = LineBuffer::default();
        assert_eq!(b.push(b"ab").unwrap(), Vec::<String>::new());
        assert_eq!(b.push(b"c\r").unwrap(), vec!["abc"]);
        assert_eq!(b.push(b"\nd\n\ne\rf").unwrap(), vec!["d", "", "e"]);
        assert_eq!(b.finish().unwrap(), Some("f".to_owned()));
        assert_eq!(b.finish().unwrap(), None);
    }

    #[test]
    fn a_multibyte_char_split_across_chunks_survives() {
        let mut b = LineBuffer::default();
        let s = "é\n".as_bytes();
        assert!(b.push(&s[..1]).unwrap().is_empty());
        assert_eq!(b.push(&s[1..]).unwrap(), vec!["é"]);
    }

    #[test]
    fn a_line_past_the_bound_is_refused() {
        let mut b = LineBuffer::default();
        let big = vec![b'x'; MAX_LINE_BYTES];
        assert!(b.push(&big).unwrap().is_empty());
        assert_eq!(b.push(b"x"), Err(LineError::TooLong));
    }

    #[test]
    fn invalid_utf8_is_refused() {
        let mut b = LineBuffer::default();
        assert_eq!(b.push(b"\xff\n"), Err(LineError::NotUtf8));
    }
}
