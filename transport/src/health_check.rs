//! The client side of a health check: one bounded HTTP/1.0 `GET` of a
//! local endpoint (`/healthz`, `/readyz`), for `iop-edge health` and
//! `iop-node health`, the commands a container's `HEALTHCHECK` runs (a
//! scratch image has no curl).

use std::io::{Read as _, Write as _};
use std::net::{TcpStream, ToSocketAddrs as _};
use std::time::{Duration, Instant};

/// The most bytes of an answer read: its status line is all that counts.
pub const MAX_ANSWER_BYTES: usize = 4096;

/// Why a health check failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HealthCheckError {
    /// The URL is not `http://host:port/path`.
    #[error("`{0}` is not an http://host:port/path URL")]
    Url(String),
    /// The host did not resolve or refused the connection.
    #[error("cannot connect to {address}: {source}")]
    Connect {
        /// `host:port`.
        address: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Writing the request or reading the answer failed or took too long.
    #[error("no answer from {address}: {source}")]
    Answer {
        /// `host:port`.
        address: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The answer is not HTTP.
    #[error("{address} answered something that is not HTTP")]
    NotHttp {
        /// `host:port`.
        address: String,
    },
    /// The endpoint answered, but not with 2xx.
    #[error("{address} answered HTTP {status}")]
    Status {
        /// `host:port`.
        address: String,
        /// The status code.
        status: u16,
    },
}

/// The `health` command of `iop-edge` and `iop-node`: [`check`] `url`
/// within `timeout_ms`; the line it prints when the answer is 2xx.
pub fn report(url: &str, timeout_ms: u64) -> Result<String, HealthCheckError> {
    let status = check(url, Duration::from_millis(timeout_ms))?;
    Ok(format!("{url}: HTTP {status}"))
}

/// `GET url` within `timeout` (connect, write and read together); `Ok`
/// with the status when it is 2xx.
pub fn check(url: &str, timeout: Duration) -> Result<u16, HealthCheckError> {
    let bad_url = || HealthCheckError::Url(url.to_owned());
    let rest = url.strip_prefix("http://").ok_or_else(bad_url)?;
    let (address, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if address.is_empty() || !address.contains(':') {
        return Err(bad_url());
    }
    let deadline = Instant::now() + timeout;
    let connect_err = |source| HealthCheckError::Connect {
        address: address.to_owned(),
        source,
    };
    let answer_err = |source| HealthCheckError::Answer {
        address: address.to_owned(),
        source,
    };
    let target = address
        .to_socket_addrs()
        .map_err(connect_err)?
        .next()
        .ok_or_else(|| connect_err(std::io::ErrorKind::NotFound.into()))?;
    let mut stream = TcpStream::connect_timeout(&target, timeout).map_err(connect_err)?;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    stream.set_write_timeout(Some(left())).map_err(answer_err)?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
        .map_err(answer_err)?;
    let mut answer = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    while answer.len() < MAX_ANSWER_BYTES && !answer.contains(&b'\n') {
        stream.set_read_timeout(Some(left())).map_err(answer_err)?;
        let n = stream.read(&mut buf).map_err(answer_err)?;
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    let status = status_of(&answer).ok_or_else(|| HealthCheckError::NotHttp {
        address: address.to_owned(),
    })?;
    if (200..300).contains(&status) {
        Ok(status)
    } else {
        Err(HealthCheckError::Status {
            address: address.to_owned(),
            status,
        })
    }
}

/// The status code of an HTTP/1 status line (`HTTP/1.1 200 OK`).
fn status_of(answer: &[u8]) -> Option<u16> {
    let line = answer.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let code = parts.next()?;
    (code.len() == 3).then(|| code.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use std::io::BufRead as _;
    use std::net::TcpListener;

    use super::*;

    /// A one-connection server answering `answer`, and its address.
    fn serve_once(answer: &'static [u8]) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = std::io::BufReader::new(stream);
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap() > 2 {
                line.clear();
            }
            let _ = reader.get_mut().write_all(answer);
        });
        address
    }

    #[test]
    fn a_2xx_answer_passes_and_others_fail_with_their_status() {
        let a = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        assert_eq!(
            check(&format!("http://{a}/healthz"), Duration::from_secs(5)).unwrap(),
            200
        );
        let a = serve_once(b"HTTP/1.1 503 Service Unavailable\r\n\r\n");
        match check(&format!("http://{a}/readyz"), Duration::from_secs(5)) {
            Err(HealthCheckError::Status { status: 503, .. }) => {}
            other => panic!("{other:?}"),
        }
        let a = serve_once(b"SSH-2.0-OpenSSH\r\n");
        assert!(matches!(
            check(&format!("http://{a}/"), Duration::from_secs(5)),
            Err(HealthCheckError::NotHttp { .. })
        ));
    }

    #[test]
    fn a_silent_server_fails_within_the_bound() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = listener.local_addr().unwrap();
        let started = Instant::now();
        let e = check(&format!("http://{a}/healthz"), Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, HealthCheckError::Answer { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(3));
        drop(listener);
    }

    #[test]
    fn a_closed_port_and_a_bad_url_are_told_apart() {
        let a = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(matches!(
            check(&format!("http://{a}/healthz"), Duration::from_secs(2)),
            Err(HealthCheckError::Connect { .. })
        ));
        for url in [
            "https://127.0.0.1:1/",
            "127.0.0.1:1/healthz",
            "http:///x",
            "http://host/x",
        ] {
            assert!(
                matches!(
                    check(url, Duration::from_secs(1)),
                    Err(HealthCheckError::Url(_))
                ),
                "{url}"
            );
        }
    }
}
