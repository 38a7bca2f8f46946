//! The body of a streamed answer, whether it follows a live run or a
//! durable response's journal: the source's next steps in, body chunks out.
//!
//! One writer for both, so they frame alike: the API's encoder renders each
//! run event; deliveries already waiting share one chunk (bounded by
//! [`MAX_DELIVERIES_PER_CHUNK`] and [`MAX_CHUNK_BYTES`]); a silent SSE
//! stream gets a keep-alive comment after each `edge.sse_keep_alive_ms` of
//! silence;
//! the terminal is the encoder's closing, interruption or in-stream failure
//! (R-GATE-3), and the request's record counts the bytes and the outcome. A
//! journal answer's SSE events are numbered with `id:` lines
//! ([`framing::SseNumbering`]) so a client can resume after the last one it
//! has (R-JRN-2). Dropping the body drops its source: a live run's driver
//! sees its receiver gone and cancels the run; a journal answer stops
//! reading, and the run it follows goes on.

use std::future::Future;

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use iop_core::edge::request::Delivery;
use iop_wire::RunEventKind;
use tokio::sync::mpsc;

use crate::api::endpoint::AnswerStream;
use crate::api::{ApiError, framing};
use crate::request_record::RequestRecord;

/// Most deliveries, already waiting when a body chunk is written, that go
/// into that one chunk.
pub const MAX_DELIVERIES_PER_CHUNK: usize = 64;

/// A body chunk stops taking waiting deliveries once it has this many bytes.
pub const MAX_CHUNK_BYTES: usize = 64 * 1024;

/// The smallest buffer a body chunk starts with; later chunks start with
/// the previous one's size, so a chunk is written without growing.
const MIN_CHUNK_CAPACITY: usize = 512;

/// What a streamed answer's source says next.
#[derive(Debug)]
pub(crate) enum Step {
    /// A run event, for the encoder to render.
    Event(RunEventKind),
    /// Nothing the answer shows.
    Nothing,
    /// The run completed: the encoder's closing frames end the stream.
    Completed,
    /// A durable response ended without its answer (`reason`: `cancelled`,
    /// `edge_restart`, ...): the encoder's interruption frames end the
    /// stream, and the request is recorded as `err`.
    Interrupted {
        /// The reason the stream shows.
        reason: String,
        /// What the request's record counts.
        err: ApiError,
    },
    /// The run failed after commit: the encoder's failure frames end the
    /// stream (R-GATE-3).
    Failed(ApiError),
}

/// Where a streamed answer's steps come from: a live run's deliveries, or
/// a durable response's journal.
pub(crate) trait AnswerSource: Send + 'static {
    /// The next step, waiting for it; `None` when the source ended without
    /// a terminal (the body ends there). Cancel-safe: a keep-alive comment
    /// drops the future, and nothing is lost.
    fn next(&mut self) -> impl Future<Output = Option<Step>> + Send;

    /// A step already waiting, if any (no waiting).
    fn ready(&mut self) -> Option<Step>;
}

/// A live run's deliveries, after its commit.
impl AnswerSource for mpsc::Receiver<Delivery> {
    async fn next(&mut self) -> Option<Step> {
        self.recv().await.map(live_step)
    }

    fn ready(&mut self) -> Option<Step> {
        self.try_recv().ok().map(live_step)
    }
}

/// What a live delivery says to the answer's body.
fn live_step(delivery: Delivery) -> Step {
    match delivery {
        Delivery::Event(event) => Step::Event(event),
        Delivery::Finish => Step::Completed,
        Delivery::Fail { kind, provider, .. } => {
            Step::Failed(ApiError::from_gate_failure_with(kind, provider.as_ref()))
        }
        Delivery::Commit { .. } | Delivery::Body(_) => Step::Nothing,
    }
}

/// A streamed answer being written: the source's steps in, body chunks out.
struct AnswerBody<A, S> {
    source: A,
    encoder: S,
    /// A journal answer's `id:` lines (SSE only); `None` for a live answer.
    numbering: Option<framing::SseNumbering>,
    record: RequestRecord,
    /// Frames due and not yet handed to the body.
    pending: Vec<u8>,
    /// The answer ended; nothing follows `pending`.
    done: bool,
    /// Longest silence before a keep-alive comment (SSE only).
    keep_alive: std::time::Duration,
    /// When a silent SSE stream gets its keep-alive comment.
    keep_alive_at: tokio::time::Instant,
}

impl<A: AnswerSource, S: AnswerStream> AnswerBody<A, S> {
    /// Encode one step into `pending`.
    fn take(&mut self, step: Step) {
        match step {
            Step::Event(event) => {
                self.encoder
                    .event(&event, iop_transport::clock::unix_ms(), &mut self.pending);
            }
            Step::Nothing => {}
            Step::Completed => {
                self.record.set("ok");
                self.encoder.closing(&mut self.pending);
                self.done = true;
            }
            Step::Interrupted { reason, err } => {
                self.record.error(&err);
                self.encoder.interrupted(&reason, &mut self.pending);
                self.done = true;
            }
            Step::Failed(err) => {
                self.record.error(&err);
                self.encoder.failure(&err, &mut self.pending);
                self.done = true;
            }
        }
    }

    /// The next body chunk: every frame due from the next step and from
    /// the steps already waiting behind it (bounded), or a keep-alive
    /// comment; `None` once the answer ended.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if self.done {
                return None;
            }
            let step = match S::KEEP_ALIVE {
                None => self.source.next().await,
                Some(comment) => {
                    match tokio::time::timeout_at(self.keep_alive_at, self.source.next()).await {
                        Ok(step) => step,
                        Err(_) => {
                            // From now, as axum's keep-alive: a body not
                            // polled for a while gets one comment, not a
                            // burst of them.
                            self.keep_alive_at = tokio::time::Instant::now() + self.keep_alive;
                            return Some(Bytes::from_static(comment));
                        }
                    }
                }
            };
            self.take(step?);
            // Steps already waiting go out in the same chunk: nothing waits
            // for them, and the body is written once instead of once per
            // step.
            let mut taken = 1;
            while !self.done
                && taken < MAX_DELIVERIES_PER_CHUNK
                && self.pending.len() < MAX_CHUNK_BYTES
            {
                let Some(step) = self.source.ready() else {
                    break;
                };
                self.take(step);
                taken += 1;
            }
            if self.pending.is_empty() {
                continue;
            }
            let chunk = match self.numbering.as_mut() {
                Some(numbering) => {
                    let mut numbered = Vec::with_capacity(self.pending.len() + 64);
                    numbering.number(&self.pending, &mut numbered);
                    self.pending.clear();
                    numbered
                }
                None => {
                    let capacity = self
                        .pending
                        .len()
                        .clamp(MIN_CHUNK_CAPACITY, MAX_CHUNK_BYTES);
                    std::mem::replace(&mut self.pending, Vec::with_capacity(capacity))
                }
            };
            // A resumed stream leaves out the events the client has.
            if chunk.is_empty() {
                continue;
            }
            self.keep_alive_at = tokio::time::Instant::now() + self.keep_alive;
            self.record.relayed_bytes += chunk.len() as u64;
            return Some(Bytes::from(chunk));
        }
    }
}

/// The body of a streamed answer until its terminal: the encoder's opening
/// frames go with the first step's. `numbering` numbers a journal answer's
/// SSE events (and leaves out those a resuming client has); a silent SSE
/// stream gets the encoder's keep-alive after each `keep_alive`.
pub(crate) fn answer_body<A: AnswerSource, S: AnswerStream>(
    source: A,
    mut encoder: S,
    numbering: Option<framing::SseNumbering>,
    keep_alive: std::time::Duration,
    record: RequestRecord,
) -> BoxStream<'static, Bytes> {
    let mut pending = Vec::with_capacity(MIN_CHUNK_CAPACITY);
    encoder.opening(&mut pending);
    let body = AnswerBody {
        source,
        encoder,
        numbering,
        record,
        pending,
        done: false,
        keep_alive,
        keep_alive_at: tokio::time::Instant::now() + keep_alive,
    };
    futures::stream::unfold(body, |mut body| async move {
        let chunk = body.next_chunk().await?;
        Some((chunk, body))
    })
    .boxed()
}

/// `body` pumped by its own task into a one-chunk channel the client's
/// connection reads: a reader that takes no chunk within `write_timeout`
/// is cut off, and what its body holds (a journal follower, its record) is
/// let go at once (R-LIM-6), as a live answer's driver does for a client
/// that stops reading.
pub(crate) fn with_write_timeout(
    mut body: BoxStream<'static, Bytes>,
    write_timeout: std::time::Duration,
) -> BoxStream<'static, Bytes> {
    let (tx, mut rx) = mpsc::channel::<Bytes>(1);
    tokio::spawn(async move {
        while let Some(chunk) = body.next().await {
            match tokio::time::timeout(write_timeout, tx.send(chunk)).await {
                Ok(Ok(())) => {}
                // The client went away.
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::info!(event = "edge_slow_reader_cut_off");
                    return;
                }
            }
        }
    });
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use iop_transport::telemetry::MetricsPipeline;
    use iop_wire::{FinishReason, RunApi, RunEventKind};

    use super::*;
    use crate::api::chat::ChatStream;
    use crate::api::framing::parse_sse;
    use crate::api::ollama::OllamaStream;
    use crate::metrics::EdgeMetrics;

    /// The default `edge.sse_keep_alive_ms`.
    const INTERVAL: std::time::Duration = std::time::Duration::from_secs(15);

    fn record() -> RequestRecord {
        RequestRecord::unobserved(
            EdgeMetrics::new(MetricsPipeline::prometheus_only("iop-edge")),
            "chat",
        )
    }

    fn text(s: &str) -> Delivery {
        Delivery::Event(RunEventKind::TextDelta(s.into()))
    }

    #[tokio::test]
    async fn deliveries_already_waiting_share_one_body_chunk_up_to_the_bound() {
        let (tx, rx) = mpsc::channel(2 * MAX_DELIVERIES_PER_CHUNK);
        for _ in 0..MAX_DELIVERIES_PER_CHUNK + 3 {
            tx.send(text("x")).await.unwrap();
        }
        let mut body = answer_body(rx, ChatStream::new("c", "m", 1), None, INTERVAL, record());
        let first = body.next().await.unwrap();
        // The role chunk, then one chunk per delivery taken.
        assert_eq!(parse_sse(&first).len(), 1 + MAX_DELIVERIES_PER_CHUNK);
        tx.send(Delivery::Event(RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: None,
        }))
        .await
        .unwrap();
        tx.send(Delivery::Finish).await.unwrap();
        let rest = body.next().await.unwrap();
        let rest = parse_sse(&rest);
        assert_eq!(rest.len(), 3 + 1 + 1, "3 texts, the finish chunk, [DONE]");
        assert_eq!(rest.last().unwrap().1, "[DONE]");
        assert!(body.next().await.is_none());
    }

    #[tokio::test]
    async fn a_chunk_stops_taking_waiting_deliveries_past_its_byte_bound() {
        let (tx, rx) = mpsc::channel(8);
        let big = "y".repeat(MAX_CHUNK_BYTES / 2);
        for _ in 0..3 {
            tx.send(text(&big)).await.unwrap();
        }
        let mut body = answer_body(rx, ChatStream::new("c", "m", 1), None, INTERVAL, record());
        let first = body.next().await.unwrap();
        assert!(first.len() > MAX_CHUNK_BYTES);
        assert_eq!(
            parse_sse(&first).len(),
            1 + 2,
            "the role chunk and two texts"
        );
        assert_eq!(parse_sse(&body.next().await.unwrap()).len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_sse_stream_gets_a_keep_alive_comment_each_interval() {
        let (tx, rx) = mpsc::channel(8);
        let start = tokio::time::Instant::now();
        let mut body = answer_body(rx, ChatStream::new("c", "m", 1), None, INTERVAL, record());
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        assert_eq!(start.elapsed(), INTERVAL);
        tx.send(text("x")).await.unwrap();
        assert_eq!(parse_sse(&body.next().await.unwrap()).len(), 2);
        // The interval counts from the last chunk sent.
        tokio::time::advance(INTERVAL / 2).await;
        tx.send(text("y")).await.unwrap();
        assert_eq!(parse_sse(&body.next().await.unwrap()).len(), 1);
        let sent = tokio::time::Instant::now();
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        assert_eq!(sent.elapsed(), INTERVAL);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_polled_late_gets_one_keep_alive_comment_not_a_burst() {
        let (_tx, rx) = mpsc::channel::<Delivery>(8);
        let mut body = answer_body(rx, ChatStream::new("c", "m", 1), None, INTERVAL, record());
        // The client reads nothing for four intervals.
        tokio::time::advance(4 * INTERVAL).await;
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        let sent = tokio::time::Instant::now();
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        assert_eq!(sent.elapsed(), INTERVAL);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ndjson_stream_has_no_keep_alive() {
        let (_tx, rx) = mpsc::channel(8);
        let mut body = answer_body(
            rx,
            OllamaStream::new("m", RunApi::Chat, 0),
            None,
            INTERVAL,
            record(),
        );
        let silent = tokio::time::timeout(10 * INTERVAL, body.next()).await;
        assert!(silent.is_err(), "nothing is sent on a silent NDJSON stream");
    }

    #[tokio::test]
    async fn events_that_write_nothing_send_no_chunk_and_a_closed_channel_ends_the_body() {
        let (tx, rx) = mpsc::channel(8);
        tx.send(Delivery::Event(RunEventKind::Started {
            session_id: "s".into(),
        }))
        .await
        .unwrap();
        drop(tx);
        let mut body = answer_body(
            rx,
            OllamaStream::new("m", RunApi::Chat, 0),
            None,
            INTERVAL,
            record(),
        );
        assert!(body.next().await.is_none());
    }

    /// Steps all durable already, as a journal answer's are when it is
    /// read after its run ended.
    struct Durable(VecDeque<Step>);

    impl AnswerSource for Durable {
        async fn next(&mut self) -> Option<Step> {
            self.0.pop_front()
        }

        fn ready(&mut self) -> Option<Step> {
            self.0.pop_front()
        }
    }

    fn ids(body: &[u8]) -> Vec<u64> {
        std::str::from_utf8(body)
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("id: "))
            .map(|id| id.parse().unwrap())
            .collect()
    }

    #[tokio::test]
    async fn a_journal_answer_numbers_its_events_and_leaves_out_those_the_client_has() {
        let steps = || {
            Durable(VecDeque::from([
                Step::Event(RunEventKind::TextDelta("a".into())),
                Step::Event(RunEventKind::TextDelta("b".into())),
                Step::Interrupted {
                    reason: "cancelled".into(),
                    err: ApiError::response_interrupted("cancelled"),
                },
            ]))
        };
        let whole = |numbering| async move {
            let body = answer_body(
                steps(),
                ChatStream::new("c", "m", 1),
                numbering,
                INTERVAL,
                record(),
            );
            body.collect::<Vec<_>>().await.concat()
        };
        let first = whole(Some(framing::SseNumbering::after(None))).await;
        // The role chunk, two texts, the interruption: each event numbered.
        let count = ids(&first).len() as u64;
        assert!(count >= 4, "{count} events");
        assert_eq!(ids(&first), (0..count).collect::<Vec<_>>());
        assert!(
            std::str::from_utf8(&first)
                .unwrap()
                .contains("response_cancelled")
        );
        let resumed = whole(Some(framing::SseNumbering::after(Some(2)))).await;
        assert_eq!(ids(&resumed), (3..count).collect::<Vec<_>>());
        let text = std::str::from_utf8(&first).unwrap();
        let after = text.split_inclusive("\n\n").skip(3).collect::<String>();
        assert_eq!(std::str::from_utf8(&resumed).unwrap(), after);
    }

    #[tokio::test]
    async fn a_live_answer_is_not_numbered() {
        let (tx, rx) = mpsc::channel(8);
        tx.send(text("x")).await.unwrap();
        tx.send(Delivery::Finish).await.unwrap();
        let body = answer_body(rx, ChatStream::new("c", "m", 1), None, INTERVAL, record());
        let body = body.collect::<Vec<_>>().await.concat();
        assert!(ids(&body).is_empty());
        assert_eq!(parse_sse(&body).last().unwrap().1, "[DONE]");
    }

    #[tokio::test(start_paused = true)]
    async fn r_lim_6_a_reader_that_stops_reading_is_cut_off_and_its_source_let_go() {
        struct Source(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Source {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let source = Source(dropped.clone());
        let endless = futures::stream::unfold(source, |s| async move {
            Some((Bytes::from_static(b"data: x\n\n"), s))
        })
        .boxed();
        let timeout = std::time::Duration::from_millis(500);
        let mut body = with_write_timeout(endless, timeout);
        // A reader that reads is served.
        for _ in 0..3 {
            assert!(body.next().await.is_some());
        }
        // Then it stops: within the write timeout its source is let go.
        tokio::time::sleep(timeout / 2).await;
        assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
        tokio::time::sleep(timeout).await;
        tokio::task::yield_now().await;
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst), "cut off");
        // What was queued is still delivered, then the body ends.
        let mut rest = 0;
        while body.next().await.is_some() {
            rest += 1;
        }
        assert!(rest <= 1);
    }
}
