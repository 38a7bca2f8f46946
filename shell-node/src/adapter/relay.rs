//! Raw HTTP relay for tunnels and Ollama API calls: the request goes to the
//! target as sent (minus hop-by-hop headers and the client's credentials),
//! the answer comes back as `Head`, `Body` chunks as they arrive, and one
//! terminal. HTTP error statuses are relayed, not turned into failures.

use futures::stream::BoxStream;
use futures::{FutureExt as _, StreamExt};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use iop_wire::{Header, ProviderTunnelFrame};

use super::{HttpTarget, MAX_BODY_CHUNK_BYTES, ProviderCallError, failed_tunnel};

/// Which paths a relay may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PathScope {
    /// Any path of the target (tunnels).
    Any,
    /// Only under `/api/` (Ollama API commands).
    OllamaApi,
}

/// One call to relay.
#[derive(Debug)]
pub(crate) struct RelayCall {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) headers: Vec<Header>,
    pub(crate) body: Vec<u8>,
    pub(crate) scope: PathScope,
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and framing, never relayed either way.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// Request headers also dropped: the target is ours (`host`), the client's
/// credential is for the Edge, not the provider (`authorization`,
/// `x-api-key`), and the Edge reads tunnelled bodies, so they must stay
/// uncompressed (`accept-encoding`).
const REQUEST_ONLY: &[&str] = &["host", "authorization", "x-api-key", "accept-encoding"];

/// The method and the normalized path (with query) of a call, or why it is
/// refused before any provider call.
pub(crate) fn validate(call: &RelayCall) -> Result<(http::Method, String), ProviderCallError> {
    let method = http::Method::from_bytes(call.method.as_bytes())
        .map_err(|_| ProviderCallError::InvalidRequest("invalid HTTP method"))?;
    if !call.path.starts_with('/') || call.path.starts_with("//") {
        return Err(ProviderCallError::InvalidRequest(
            "path must start with a single `/`",
        ));
    }
    if call.path.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err(ProviderCallError::InvalidRequest(
            "path has control characters",
        ));
    }
    let path = if call.path.bytes().all(is_plain) {
        // Nothing URL normalization would change (no dot segment, escape,
        // query or character it encodes): the common call
        // (`/v1/chat/completions`) skips the parse.
        call.path.clone()
    } else {
        normalized(&call.path)?
    };
    if call.scope == PathScope::OllamaApi && !path.starts_with("/api/") {
        return Err(ProviderCallError::InvalidRequest(
            "Ollama API paths start with /api/",
        ));
    }
    Ok((method, path))
}

/// A byte of a path that URL normalization leaves as it is wherever it
/// stands: letters, digits, `/`, `-`, `_` and `~` (no `.`, `%`, `?`, `#`
/// or `\\`, and nothing it percent-encodes).
fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'~')
}

/// `path` (with its query) as the target will see it: dot segments
/// (`/api/../v1`, `/api/%2e%2e/v1`) resolved, a fragment dropped, what
/// must be escaped escaped.
fn normalized(path: &str) -> Result<String, ProviderCallError> {
    let url = url::Url::parse(&format!("http://target{path}"))
        .map_err(|_| ProviderCallError::InvalidRequest("invalid path"))?;
    if url.host_str() != Some("target") {
        return Err(ProviderCallError::InvalidRequest("invalid path"));
    }
    let mut path = url.path().to_owned();
    if let Some(q) = url.query() {
        path.push('?');
        path.push_str(q);
    }
    Ok(path)
}

/// The headers to send upstream.
pub(crate) fn request_headers(headers: &[Header]) -> Result<HeaderMap, ProviderCallError> {
    let listed = connection_listed(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let mut out = HeaderMap::new();
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if HOP_BY_HOP.contains(&lower.as_str())
            || REQUEST_ONLY.contains(&lower.as_str())
            || listed.contains(&lower)
        {
            continue;
        }
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| ProviderCallError::InvalidRequest("invalid header name"))?;
        let value = HeaderValue::from_str(value)
            .map_err(|_| ProviderCallError::InvalidRequest("invalid header value"))?;
        out.append(name, value);
    }
    Ok(out)
}

/// The headers to relay back (non-UTF-8 values are dropped).
pub(crate) fn response_headers(headers: &HeaderMap) -> Vec<Header> {
    let listed = connection_listed(
        headers
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?))),
    );
    headers
        .iter()
        .filter(|(k, _)| {
            !HOP_BY_HOP.contains(&k.as_str()) && !listed.iter().any(|l| l == k.as_str())
        })
        .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect()
}

/// Header names a `Connection` header lists (also hop-by-hop).
fn connection_listed<'a>(headers: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    headers
        .filter(|(k, _)| k.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, v)| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// Pieces of a tunnelled body already read are merged into one `Body`
/// frame until it holds this many bytes (a piece is never split for it).
/// Small on purpose: the Edge queues a few dozen frames per stream for a
/// client that reads slowly, so this, not the frame bound, is what such a
/// stream usually holds there per place; a few KiB already carry dozens
/// of SSE events.
pub(crate) const MERGED_BODY_BYTES: usize = 4 * 1024;

/// `Body` frames of one provider chunk, split at [`MAX_BODY_CHUNK_BYTES`].
pub(crate) fn body_frames(chunk: &[u8]) -> impl Iterator<Item = ProviderTunnelFrame> + '_ {
    chunk
        .chunks(MAX_BODY_CHUNK_BYTES)
        .map(|piece| ProviderTunnelFrame::Body(piece.to_vec()))
}

/// Relay `call` to an HTTP target.
pub(super) fn relay(
    target: HttpTarget,
    call: RelayCall,
    auth: Option<String>,
) -> BoxStream<'static, ProviderTunnelFrame> {
    let prepared = validate(&call).and_then(|mp| Ok((mp, request_headers(&call.headers)?)));
    let ((method, path), headers) = match prepared {
        Ok(x) => x,
        Err(e) => return failed_tunnel(e),
    };
    let url = format!("{}{path}", target.base_url);
    let body = call.body;
    Box::pin(async_stream::stream! {
        let request = target.http.request(method, url).headers(headers).body(body);
        let response = match target.send(request, auth).await {
            Ok(r) => r,
            Err(e) => {
                yield ProviderTunnelFrame::Failure(e.failure());
                return;
            }
        };
        yield ProviderTunnelFrame::Head {
            status: response.status().as_u16(),
            headers: response_headers(response.headers()),
        };
        let mut bytes = response.bytes_stream();
        // What the body said after the pieces merged into the last frame.
        let mut after = None;
        loop {
            let next = match after.take() {
                Some(next) => next,
                None => bytes.next().await,
            };
            match next {
                Some(Ok(chunk)) => {
                    // Pieces the provider already sent go in one frame
                    // (one for each event of a stream otherwise): fewer
                    // frames to write, and for the Edge to read and relay.
                    let mut merged: Option<Vec<u8>> = None;
                    while merged.as_ref().map_or(chunk.len(), Vec::len) < MERGED_BODY_BYTES {
                        match bytes.next().now_or_never() {
                            Some(Some(Ok(more))) => merged
                                .get_or_insert_with(|| chunk.to_vec())
                                .extend_from_slice(&more),
                            Some(other) => {
                                after = Some(other);
                                break;
                            }
                            None => break,
                        }
                    }
                    match merged {
                        // Within one frame's bound the merged pieces move
                        // into it, not copied again.
                        Some(merged) if merged.len() <= MAX_BODY_CHUNK_BYTES => {
                            yield ProviderTunnelFrame::Body(merged);
                        }
                        merged => {
                            for frame in body_frames(merged.as_deref().unwrap_or(&chunk)) {
                                yield frame;
                            }
                        }
                    }
                }
                Some(Err(e)) => {
                    yield ProviderTunnelFrame::Failure(super::error::from_http(e, true).failure());
                    return;
                }
                None => break,
            }
        }
        yield ProviderTunnelFrame::End;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(path: &str, scope: PathScope) -> RelayCall {
        RelayCall {
            method: "GET".into(),
            path: path.into(),
            headers: Vec::new(),
            body: Vec::new(),
            scope,
        }
    }

    #[test]
    fn ollama_api_paths_stay_under_api_after_normalization() {
        assert_eq!(
            validate(&call("/api/tags", PathScope::OllamaApi))
                .unwrap()
                .1,
            "/api/tags"
        );
        for bad in [
            "/v1/models",
            "/api/../v1/models",
            "/api/%2e%2e/v1/models",
            "api/tags",
            "//evil/api/x",
        ] {
            assert!(
                matches!(
                    validate(&call(bad, PathScope::OllamaApi)),
                    Err(ProviderCallError::InvalidRequest(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(
            validate(&call("/v1/models?x=1", PathScope::Any)).unwrap().1,
            "/v1/models?x=1"
        );
    }

    /// Every path of up to five bytes after its `/` over an alphabet with
    /// each byte that normalization treats specially: where the fast path
    /// takes a path as it is, the URL parse gives the same path.
    #[test]
    fn a_plain_path_is_what_normalization_makes_of_it() {
        const ALPHABET: &[u8] = b"aZ9/-_~.%2e?#\\";
        let mut plain = 0;
        let mut paths = vec![String::from("/")];
        for _ in 0..5 {
            let mut longer = Vec::with_capacity(paths.len() * ALPHABET.len());
            for path in &paths {
                for &b in ALPHABET {
                    let mut next = path.clone();
                    next.push(b as char);
                    // A path with a byte that is not plain never takes the
                    // fast path, nor does any path it begins.
                    if next.starts_with("//") || !next.bytes().all(is_plain) {
                        continue;
                    }
                    plain += 1;
                    assert_eq!(normalized(&next).unwrap(), next, "{next}");
                    let (_, took) = validate(&call(&next, PathScope::Any)).unwrap();
                    assert_eq!(took, next);
                    longer.push(next);
                }
            }
            paths = longer;
        }
        // The alphabet's plain bytes, five positions: the fast path was
        // checked, not skipped.
        assert!(plain > 10_000, "{plain}");
        // And what is not plain still goes through the parse.
        for (path, expect) in [
            ("/api/./tags", "/api/tags"),
            ("/a/%2e%2e/b", "/b"),
            ("/a#frag", "/a"),
            ("/a\\b", "/a/b"),
            ("/a?b=1#f", "/a?b=1"),
            ("/v1/models/llama3.1", "/v1/models/llama3.1"),
        ] {
            assert_eq!(
                validate(&call(path, PathScope::Any)).unwrap().1,
                expect,
                "{path}"
            );
        }
    }

    #[test]
    fn hop_by_hop_and_client_credentials_are_not_relayed() {
        let headers: Vec<Header> = [
            ("Host", "edge"),
            ("Authorization", "Bearer client-key"),
            ("Connection", "keep-alive, X-Private"),
            ("X-Private", "1"),
            ("Content-Length", "3"),
            ("Accept-Encoding", "gzip"),
            ("Content-Type", "application/json"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let out = request_headers(&headers).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out["content-type"], "application/json");
    }
}
