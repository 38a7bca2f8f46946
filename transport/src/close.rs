//! Closing a connection with a typed [`CloseCode`] and reading it back.

use iop_wire::CloseCode;

/// Close `conn` with `code` as the QUIC application error code and its
/// stable name (e.g. `heartbeat_timeout`) as the reason phrase.
pub fn close_connection(conn: &quinn::Connection, code: CloseCode) {
    conn.close(code.code().into(), code.as_str().as_bytes());
}

/// The [`CloseCode`] the peer closed with, if it closed the connection at
/// the application level with a code this version knows.
pub fn close_code_of(error: &quinn::ConnectionError) -> Option<CloseCode> {
    match error {
        quinn::ConnectionError::ApplicationClosed(close) => {
            CloseCode::from_code(close.error_code.into_inner())
        }
        _ => None,
    }
}
