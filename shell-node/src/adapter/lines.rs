//! Incremental, bounded line splitting over a byte stream (NDJSON). A line
//! may be split across any number of chunks, and a `\r\n` pair across two.
//! Lines are handed out borrowed from the buffer: splitting copies nothing
//! per line.

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

/// Splits bytes into lines ended by `\n`, `\r\n` or `\r`: feed chunks with
/// [`LineBuffer::extend`], take lines with [`LineBuffer::next_line`], and
/// the unterminated last one with [`LineBuffer::last_line`].
#[derive(Debug, Default)]
pub struct LineBuffer {
    /// Bytes received; `buf[pos..]` is not consumed yet.
    buf: Vec<u8>,
    pos: usize,
    /// The last line ended in `\r`: a `\n` next is the rest of that end.
    skip_lf: bool,
}

impl LineBuffer {
    /// Append a chunk.
    pub fn extend(&mut self, chunk: &[u8]) {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete line (without its terminator), or `None` until
    /// more bytes arrive. A line past [`MAX_LINE_BYTES`] is refused as soon
    /// as it is longer, complete or not.
    pub fn next_line(&mut self) -> Result<Option<&str>, LineError> {
        if self.skip_lf && self.pos < self.buf.len() {
            self.skip_lf = false;
            if self.buf[self.pos] == b'\n' {
                self.pos += 1;
            }
        }
        let rest = &self.buf[self.pos..];
        let Some(len) = memchr::memchr2(b'\n', b'\r', rest) else {
            if rest.len() > MAX_LINE_BYTES {
                return Err(LineError::TooLong);
            }
            return Ok(None);
        };
        if len > MAX_LINE_BYTES {
            return Err(LineError::TooLong);
        }
        let line = self.pos..self.pos + len;
        self.skip_lf = rest[len] == b'\r';
        self.pos += len + 1;
        std::str::from_utf8(&self.buf[line])
            .map(Some)
            .map_err(|_| LineError::NotUtf8)
    }

    /// At the end of the stream: the unterminated last line, if any.
    pub fn last_line(&mut self) -> Result<Option<&str>, LineError> {
        let rest = &self.buf[self.pos..];
        self.pos = self.buf.len();
        if rest.is_empty() {
            return Ok(None);
        }
        if rest.len() > MAX_LINE_BYTES {
            return Err(LineError::TooLong);
        }
        std::str::from_utf8(rest)
            .map(Some)
            .map_err(|_| LineError::NotUtf8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line from `chunks` fed one by one, then the last one.
    fn lines(chunks: &[&[u8]]) -> Result<Vec<String>, LineError> {
        let mut b = LineBuffer::default();
        let mut out = Vec::new();
        for chunk in chunks {
            b.extend(chunk);
            while let Some(line) = b.next_line()? {
                out.push(line.to_owned());
            }
        }
        if let Some(last) = b.last_line()? {
            out.push(last.to_owned());
        }
        Ok(out)
    }

    #[test]
    fn lines_split_across_chunks_and_crlf_pairs_are_joined() {
        assert_eq!(
            lines(&[b"ab", b"c\r", b"\nd\n\ne\rf"]).unwrap(),
            vec!["abc", "d", "", "e", "f"]
        );
        let whole: &[u8] = b"a\r\nb\rc\n\r\n\nd";
        let one = lines(&[whole]).unwrap();
        assert_eq!(one, vec!["a", "b", "c", "", "", "d"]);
        for size in 1..whole.len() {
            let split: Vec<&[u8]> = whole.chunks(size).collect();
            assert_eq!(lines(&split).unwrap(), one, "chunks of {size}");
        }
    }

    #[test]
    fn a_multibyte_char_split_across_chunks_survives() {
        let s = "é\n".as_bytes();
        assert_eq!(lines(&[&s[..1], &s[1..]]).unwrap(), vec!["é"]);
    }

    #[test]
    fn a_line_past_the_bound_is_refused() {
        let big = vec![b'x'; MAX_LINE_BYTES];
        assert_eq!(lines(&[&big, b"\n"]).unwrap()[0].len(), MAX_LINE_BYTES);
        assert_eq!(lines(&[&big, b"x"]), Err(LineError::TooLong));
        let mut b = LineBuffer::default();
        b.extend(&big);
        assert_eq!(b.next_line(), Ok(None));
        b.extend(b"x");
        assert_eq!(b.next_line(), Err(LineError::TooLong));
    }

    #[test]
    fn invalid_utf8_is_refused() {
        assert_eq!(lines(&[b"\xff\n"]), Err(LineError::NotUtf8));
    }
}
