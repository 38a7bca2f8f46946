//! How the journal is laid out in JetStream: names, the record value, and
//! the framing of the messages of an append and of a request.
//!
//! Everything here is pure (no I/O), so it is unit-tested alone.

use bytes::{BufMut, Bytes, BytesMut};
use iop_core::journal::{EdgeLease, JournalEvent, RecordMeta};
use serde::{Deserialize, Serialize};

/// A response id as one subject token and key segment: `[A-Za-z0-9_-]`
/// stay, every other byte is `=HH` (upper-case hex); the empty id is `=`.
/// Injective, so two ids never share a subject; readable for the ids the
/// Edge makes (`resp_…`, `chatcmpl-…`).
pub(crate) fn token(id: &str) -> String {
    if id.is_empty() {
        return "=".into();
    }
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(char::from(b));
        } else {
            out.push('=');
            out.push_str(&hex(&[b]));
        }
    }
    out
}

/// Upper-case hex of `bytes`, as [`token`] writes an escaped byte.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// The names one store uses, derived once from its options.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// `$KV.<bucket>.`: the subject prefix of the bucket's keys.
    pub kv_prefix: String,
    /// `<prefix>.ev.`: events of a response are on `<prefix>.ev.<token>`.
    pub events_prefix: String,
    /// `<prefix>.req.`: the request of a response is on `<prefix>.req.<token>`.
    pub request_prefix: String,
}

impl Names {
    pub(crate) fn new(bucket: &str, subject_prefix: &str) -> Self {
        Names {
            kv_prefix: format!("$KV.{bucket}."),
            events_prefix: format!("{subject_prefix}.ev."),
            request_prefix: format!("{subject_prefix}.req."),
        }
    }

    /// The key of a record.
    pub(crate) fn record_key(tok: &str) -> String {
        format!("{RECORD_KEY_PREFIX}{tok}")
    }

    /// The key of an Edge's ownership lease.
    pub(crate) fn lease_key(edge_id: &str) -> String {
        format!("{LEASE_KEY_PREFIX}{}", token(edge_id))
    }

    /// The key of an idempotency key entry (the hash, never the key).
    pub(crate) fn idempotency_key(hash: &[u8; 32]) -> String {
        format!("{IDEMPOTENCY_KEY_PREFIX}{}", hex(hash))
    }

    /// The subject a bucket key is stored on.
    pub(crate) fn kv_subject(&self, key: &str) -> String {
        format!("{}{key}", self.kv_prefix)
    }

    pub(crate) fn events_subject(&self, tok: &str) -> String {
        format!("{}{tok}", self.events_prefix)
    }

    pub(crate) fn request_subject(&self, tok: &str) -> String {
        format!("{}{tok}", self.request_prefix)
    }

    /// The stream subjects the events stream must hold.
    pub(crate) fn stream_subjects(&self) -> Vec<String> {
        vec![
            format!("{}*", self.events_prefix),
            format!("{}*", self.request_prefix),
        ]
    }
}

/// Keys of records start with this.
pub(crate) const RECORD_KEY_PREFIX: &str = "rec.";
/// Keys of idempotency key entries start with this.
pub(crate) const IDEMPOTENCY_KEY_PREFIX: &str = "key.";
/// Keys of Edges' ownership leases start with this.
pub(crate) const LEASE_KEY_PREFIX: &str = "lease.";

/// A record as the bucket holds it: the journal's [`RecordMeta`] and where
/// its request and committed events are in the events stream. This value,
/// written with compare-and-set on its revision, is the commit point of
/// every operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RecordValue {
    /// The journal's record.
    pub meta: RecordMeta,
    /// Names this incarnation of the id: the stream sequence of its
    /// request's first part (unique, and below every message of it).
    pub incarnation: u64,
    /// The stream sequences of the request's parts, in order.
    pub request_parts: Vec<u64>,
    /// The stream sequence of the last committed append message (0: none).
    /// Readers read the record's events up to here and no further.
    pub events_last_msg: u64,
}

/// The record format this build writes: 3, the record names its owner
/// and its API key.
const RECORD_FORMAT: u8 = 3;
/// The format before records named their owner: read, never written.
const RECORD_FORMAT_UNOWNED: u8 = 1;
/// The format before records named their API key: read, never written.
const RECORD_FORMAT_KEYLESS: u8 = 2;

/// A record value of format 1 ([`RECORD_FORMAT_UNOWNED`]) or 2
/// ([`RECORD_FORMAT_KEYLESS`]), by the record layout `M` of its format.
#[derive(Serialize, Deserialize)]
struct RecordValueOf<M> {
    meta: M,
    incarnation: u64,
    request_parts: Vec<u64>,
    events_last_msg: u64,
}

impl<M> RecordValueOf<M> {
    fn upgrade(self, meta: impl FnOnce(M) -> RecordMeta) -> RecordValue {
        RecordValue {
            meta: meta(self.meta),
            incarnation: self.incarnation,
            request_parts: self.request_parts,
            events_last_msg: self.events_last_msg,
        }
    }
}

/// The lease format this build writes and reads.
const LEASE_FORMAT: u8 = 1;

/// Why a stored value could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DecodeError {
    #[error("unknown record format {0}")]
    RecordFormat(u8),
    #[error("malformed record: {0}")]
    Record(String),
    #[error("malformed journal message: {0}")]
    Message(&'static str),
}

impl RecordValue {
    pub(crate) fn encode(&self) -> Result<Bytes, DecodeError> {
        let mut out = vec![RECORD_FORMAT];
        let body = postcard::to_allocvec(self).map_err(|e| DecodeError::Record(e.to_string()))?;
        out.extend_from_slice(&body);
        Ok(out.into())
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let malformed = |e: postcard::Error| DecodeError::Record(e.to_string());
        match bytes.split_first() {
            Some((&RECORD_FORMAT, body)) => postcard::from_bytes(body).map_err(malformed),
            Some((&RECORD_FORMAT_UNOWNED, body)) => {
                let old: RecordValueOf<iop_store::legacy::RecordMetaV1> =
                    postcard::from_bytes(body).map_err(malformed)?;
                Ok(old.upgrade(iop_store::legacy::RecordMetaV1::upgrade))
            }
            Some((&RECORD_FORMAT_KEYLESS, body)) => {
                let old: RecordValueOf<iop_store::legacy::RecordMetaV2> =
                    postcard::from_bytes(body).map_err(malformed)?;
                Ok(old.upgrade(iop_store::legacy::RecordMetaV2::upgrade))
            }
            Some((&other, _)) => Err(DecodeError::RecordFormat(other)),
            None => Err(DecodeError::Record("empty".into())),
        }
    }
}

/// An Edge's ownership lease as the bucket holds it under
/// `lease.<token(edge_id)>`: a format byte, then postcard.
pub(crate) fn encode_lease(lease: &EdgeLease) -> Result<Bytes, DecodeError> {
    let mut out = vec![LEASE_FORMAT];
    let body = postcard::to_allocvec(lease).map_err(|e| DecodeError::Record(e.to_string()))?;
    out.extend_from_slice(&body);
    Ok(out.into())
}

/// A lease value back.
pub(crate) fn decode_lease(bytes: &[u8]) -> Result<EdgeLease, DecodeError> {
    match bytes.split_first() {
        Some((&LEASE_FORMAT, body)) => {
            postcard::from_bytes(body).map_err(|e| DecodeError::Record(e.to_string()))
        }
        Some((&other, _)) => Err(DecodeError::RecordFormat(other)),
        None => Err(DecodeError::Record("empty".into())),
    }
}

/// The head of one message of an append: who wrote it, from which
/// record revision, and which part of the append it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AppendHead {
    /// The record revision the writer decided on: a message whose base
    /// revision is below the record's current revision can never be
    /// committed (its compare-and-set expects that older revision).
    pub base_revision: u64,
    /// The writer's epoch (for the operator; the record decides).
    pub epoch: u64,
    /// The number of the append's first event.
    pub first_seq: u64,
    /// Events in the whole append.
    pub count: u32,
    /// This part's index, from 0.
    pub part: u16,
    /// Parts of the append.
    pub parts: u16,
}

const APPEND_MAGIC: [u8; 2] = [b'J', 1];
/// Bytes of an append message's head.
pub(crate) const APPEND_HEAD_BYTES: usize = 2 + 8 + 8 + 8 + 4 + 2 + 2;
const REQUEST_MAGIC: [u8; 2] = [b'R', 1];
/// Bytes of a request part's head.
pub(crate) const REQUEST_HEAD_BYTES: usize = 2 + 2 + 2;

impl AppendHead {
    fn put(&self, out: &mut BytesMut) {
        out.put_slice(&APPEND_MAGIC);
        out.put_u64(self.base_revision);
        out.put_u64(self.epoch);
        out.put_u64(self.first_seq);
        out.put_u32(self.count);
        out.put_u16(self.part);
        out.put_u16(self.parts);
    }

    /// The head of a message body and the rest.
    pub(crate) fn parse(body: &[u8]) -> Result<(AppendHead, &[u8]), DecodeError> {
        if body.len() < APPEND_HEAD_BYTES || body[..2] != APPEND_MAGIC {
            return Err(DecodeError::Message("not an append message"));
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&body[i..i + 8]);
            u64::from_be_bytes(b)
        };
        let head = AppendHead {
            base_revision: u64_at(2),
            epoch: u64_at(10),
            first_seq: u64_at(18),
            count: u32::from_be_bytes([body[26], body[27], body[28], body[29]]),
            part: u16::from_be_bytes([body[30], body[31]]),
            parts: u16::from_be_bytes([body[32], body[33]]),
        };
        if head.parts == 0 || head.part >= head.parts {
            return Err(DecodeError::Message("bad part numbering"));
        }
        Ok((head, &body[APPEND_HEAD_BYTES..]))
    }
}

/// An append too big to frame (more than `u16::MAX` parts or an event
/// over 4 GiB): never reached under the journal's record bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the append cannot be framed in messages of {0} bytes")]
pub(crate) struct TooBig(pub usize);

/// Frame `events` (numbered consecutively, as the journal checked) as the
/// bodies of one or more messages of at most `max_message_bytes` each.
pub(crate) fn frame_append(
    base_revision: u64,
    epoch: u64,
    events: &[JournalEvent],
    max_message_bytes: usize,
) -> Result<Vec<Bytes>, TooBig> {
    let room = max_message_bytes.saturating_sub(APPEND_HEAD_BYTES);
    if room == 0 {
        return Err(TooBig(max_message_bytes));
    }
    let first_seq = events.first().map_or(0, |e| e.seq);
    let count = u32::try_from(events.len()).map_err(|_| TooBig(max_message_bytes))?;
    let mut data = BytesMut::new();
    for event in events {
        let len = u32::try_from(event.payload.len()).map_err(|_| TooBig(max_message_bytes))?;
        data.put_u32(len);
        data.put_slice(&event.payload);
    }
    let chunks: Vec<&[u8]> = if data.is_empty() {
        vec![&[]]
    } else {
        data.chunks(room).collect()
    };
    let parts = u16::try_from(chunks.len()).map_err(|_| TooBig(max_message_bytes))?;
    Ok(chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| {
            let mut out = BytesMut::with_capacity(APPEND_HEAD_BYTES + chunk.len());
            AppendHead {
                base_revision,
                epoch,
                first_seq,
                count,
                part: i as u16,
                parts,
            }
            .put(&mut out);
            out.put_slice(chunk);
            out.freeze()
        })
        .collect())
}

/// The events of one append from its parts' data, in order.
pub(crate) fn unframe_append(
    head: &AppendHead,
    data: &[u8],
) -> Result<Vec<JournalEvent>, DecodeError> {
    let mut events = Vec::with_capacity(head.count as usize);
    let mut rest = data;
    for i in 0..u64::from(head.count) {
        if rest.len() < 4 {
            return Err(DecodeError::Message("truncated event length"));
        }
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        rest = &rest[4..];
        if rest.len() < len {
            return Err(DecodeError::Message("truncated event payload"));
        }
        events.push(JournalEvent {
            seq: head.first_seq + i,
            payload: rest[..len].to_vec(),
        });
        rest = &rest[len..];
    }
    if !rest.is_empty() {
        return Err(DecodeError::Message("bytes after the last event"));
    }
    Ok(events)
}

/// Frame a request as the bodies of at least one message (an empty
/// request still has one: its sequence names the incarnation).
pub(crate) fn frame_request(
    request: &[u8],
    max_message_bytes: usize,
) -> Result<Vec<Bytes>, TooBig> {
    let room = max_message_bytes.saturating_sub(REQUEST_HEAD_BYTES);
    if room == 0 {
        return Err(TooBig(max_message_bytes));
    }
    let chunks: Vec<&[u8]> = if request.is_empty() {
        vec![&[]]
    } else {
        request.chunks(room).collect()
    };
    let parts = u16::try_from(chunks.len()).map_err(|_| TooBig(max_message_bytes))?;
    Ok(chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| {
            let mut out = BytesMut::with_capacity(REQUEST_HEAD_BYTES + chunk.len());
            out.put_slice(&REQUEST_MAGIC);
            out.put_u16(i as u16);
            out.put_u16(parts);
            out.put_slice(chunk);
            out.freeze()
        })
        .collect())
}

/// The data of request part `part` of `parts`.
pub(crate) fn unframe_request_part(
    body: &[u8],
    part: usize,
    parts: usize,
) -> Result<&[u8], DecodeError> {
    if body.len() < REQUEST_HEAD_BYTES || body[..2] != REQUEST_MAGIC {
        return Err(DecodeError::Message("not a request part"));
    }
    let got_part = usize::from(u16::from_be_bytes([body[2], body[3]]));
    let got_parts = usize::from(u16::from_be_bytes([body[4], body[5]]));
    if (got_part, got_parts) != (part, parts) {
        return Err(DecodeError::Message("request part out of place"));
    }
    Ok(&body[REQUEST_HEAD_BYTES..])
}

#[cfg(test)]
mod tests {
    use iop_core::journal::{JournalApi, RecordStatus, Terminal};

    use super::*;

    fn event(seq: u64, n: usize) -> JournalEvent {
        JournalEvent {
            seq,
            payload: (0..n).map(|i| (i % 251) as u8).collect(),
        }
    }

    #[test]
    fn tokens_are_injective_subject_tokens_and_keys() {
        let ids = [
            "",
            "=",
            "=3D",
            "a.b",
            "a=2Eb",
            "resp_0123",
            "chatcmpl-x",
            "a b",
            "é",
            "*",
            ">",
        ];
        let toks: Vec<String> = ids.iter().map(|id| token(id)).collect();
        for (i, a) in toks.iter().enumerate() {
            for b in &toks[i + 1..] {
                assert_ne!(a, b);
            }
            assert!(
                a.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'='),
                "{a}"
            );
        }
        assert_eq!(token("resp_0123"), "resp_0123");
        assert_eq!(token("a.b"), "a=2Eb");
    }

    #[test]
    fn an_append_round_trips_through_its_parts() {
        let events: Vec<JournalEvent> = (5..25).map(|s| event(s, (s as usize) * 37)).collect();
        for max in [APPEND_HEAD_BYTES + 1, 64, 1000, 1 << 20] {
            let parts = frame_append(7, 2, &events, max).unwrap();
            let mut data = Vec::new();
            let mut head0 = None;
            for (i, body) in parts.iter().enumerate() {
                assert!(body.len() <= max);
                let (head, rest) = AppendHead::parse(body).unwrap();
                assert_eq!((head.part as usize, head.parts as usize), (i, parts.len()));
                assert_eq!((head.base_revision, head.epoch, head.first_seq), (7, 2, 5));
                head0.get_or_insert(head);
                data.extend_from_slice(rest);
            }
            assert_eq!(unframe_append(&head0.unwrap(), &data).unwrap(), events);
        }
        assert!(frame_append(1, 1, &events, APPEND_HEAD_BYTES).is_err());
    }

    #[test]
    fn a_request_round_trips_and_an_empty_one_has_a_part() {
        let request: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let parts = frame_request(&request, 999).unwrap();
        let mut back = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            back.extend_from_slice(unframe_request_part(p, i, parts.len()).unwrap());
        }
        assert_eq!(back, request);
        let empty = frame_request(b"", 999).unwrap();
        assert_eq!(empty.len(), 1);
        assert_eq!(unframe_request_part(&empty[0], 0, 1).unwrap(), b"");
        assert!(unframe_request_part(&empty[0], 0, 2).is_err());
    }

    #[test]
    fn a_record_value_round_trips_and_a_foreign_format_is_refused() {
        let value = RecordValue {
            meta: RecordMeta {
                id: "r".into(),
                principal: "p".into(),
                api: JournalApi::ChatCompletions,
                model: "m".into(),
                fingerprint: [3; 32],
                idempotency_key: Some([4; 32]),
                background: true,
                created_unix_ms: 9,
                epoch: 2,
                last_seq: 3,
                terminal: Some(Terminal {
                    status: RecordStatus::Incomplete,
                    reason: Some("edge_restart".into()),
                    message: None,
                    at_unix_ms: 10,
                }),
                expires_unix_ms: 11,
                stored_bytes: 12,
                owner: "edge-a".into(),
                key_id: "key-a".into(),
            },
            incarnation: 40,
            request_parts: vec![40, 41],
            events_last_msg: 50,
        };
        let bytes = value.encode().unwrap();
        assert_eq!(RecordValue::decode(&bytes).unwrap(), value);
        // Format 1, before records named their owner, reads as unowned.
        #[derive(Serialize)]
        struct V1<'a> {
            meta: iop_store::legacy::RecordMetaV1,
            incarnation: u64,
            request_parts: &'a [u64],
            events_last_msg: u64,
        }
        let m = &value.meta;
        let v1 = V1 {
            meta: iop_store::legacy::RecordMetaV1 {
                id: m.id.clone(),
                principal: m.principal.clone(),
                api: m.api,
                model: m.model.clone(),
                fingerprint: m.fingerprint,
                idempotency_key: m.idempotency_key,
                background: m.background,
                created_unix_ms: m.created_unix_ms,
                epoch: m.epoch,
                last_seq: m.last_seq,
                terminal: m.terminal.clone(),
                expires_unix_ms: m.expires_unix_ms,
                stored_bytes: m.stored_bytes,
            },
            incarnation: value.incarnation,
            request_parts: &value.request_parts,
            events_last_msg: value.events_last_msg,
        };
        let mut old = vec![1u8];
        old.extend(postcard::to_allocvec(&v1).unwrap());
        let upgraded = RecordValue::decode(&old).unwrap();
        assert_eq!(upgraded.meta.owner, iop_core::journal::NO_OWNER);
        assert_eq!(upgraded.meta.key_id, iop_core::journal::NO_KEY_ID);
        assert_eq!(
            RecordValue {
                meta: RecordMeta {
                    owner: "edge-a".into(),
                    key_id: "key-a".into(),
                    ..upgraded.meta
                },
                ..upgraded
            },
            value
        );
        // Format 2, before records named their API key, reads as of no
        // key: it counts for its principal only.
        let v2 = RecordValueOf {
            meta: iop_store::legacy::RecordMetaV2::from_current(m),
            incarnation: value.incarnation,
            request_parts: value.request_parts.clone(),
            events_last_msg: value.events_last_msg,
        };
        let mut old = vec![2u8];
        old.extend(postcard::to_allocvec(&v2).unwrap());
        let upgraded = RecordValue::decode(&old).unwrap();
        assert_eq!(upgraded.meta.key_id, iop_core::journal::NO_KEY_ID);
        assert_eq!(
            RecordValue {
                meta: RecordMeta {
                    key_id: "key-a".into(),
                    ..upgraded.meta
                },
                ..upgraded
            },
            value
        );
        let mut other = bytes.to_vec();
        other[0] = 9;
        assert_eq!(
            RecordValue::decode(&other),
            Err(DecodeError::RecordFormat(9))
        );
        assert!(RecordValue::decode(&[]).is_err());
    }

    #[test]
    fn a_lease_round_trips_and_its_key_is_one_token() {
        let lease = EdgeLease {
            edge_id: "edge.a".into(),
            incarnation: 3,
            ttl_ms: 15_000,
            renewed_unix_ms: 99,
        };
        assert_eq!(decode_lease(&encode_lease(&lease).unwrap()).unwrap(), lease);
        assert_eq!(Names::lease_key("edge.a"), "lease.edge=2Ea");
        assert!(decode_lease(&[7, 1]).is_err());
    }
}
