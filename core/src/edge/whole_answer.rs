//! The bound on a non-streaming answer (R-LIM-3): the whole answer is
//! built in memory before a byte is sent, so the text and tool-call bytes
//! it accumulates are counted, and past the bound the run is abandoned.
//! The live path and a durable answer read back from the journal count
//! alike.

use iop_wire::RunEventKind;

/// The most text and tool-call bytes a non-streaming answer accumulates.
pub const MAX_WHOLE_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// The most bytes of a tunnelled non-streaming answer (the provider's own
/// body) the Edge collects to send whole (R-LIM-3); past it the rest is
/// streamed to the client as it comes, so a tunnelled answer never holds
/// more than this (and one frame) in memory.
pub const MAX_COLLECTED_TUNNEL_BYTES: usize = 256 * 1024;

/// What rendering a stored answer whole takes at most, per byte of the
/// events its record holds (R-LIM-6): the text folded from the events,
/// the object built from it and that object serialized, each about the
/// text's size, held at once at the end of the build.
pub const RENDERED_BYTES_PER_EVENT_BYTE: usize = 3;

/// The memory a read charges its caller's share before it renders a
/// stored answer whole from a record whose events hold `event_bytes`
/// (R-LIM-6): an upper bound, known from the record's metadata before
/// any event is read.
pub fn rendering_bytes(event_bytes: u64) -> usize {
    usize::try_from(event_bytes)
        .unwrap_or(usize::MAX)
        .saturating_mul(RENDERED_BYTES_PER_EVENT_BYTE)
}

/// The answer went past its bound: abandon the run and answer
/// `response_too_large`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerTooLarge {
    /// The bound it went past, in bytes.
    pub limit_bytes: usize,
}

/// The bytes a non-streaming answer has accumulated so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WholeAnswerBudget {
    used: usize,
    limit: usize,
}

impl Default for WholeAnswerBudget {
    fn default() -> Self {
        Self::new(MAX_WHOLE_ANSWER_BYTES)
    }
}

impl WholeAnswerBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        WholeAnswerBudget { used: 0, limit }
    }

    /// Count `event`; an error once the answer holds more than the limit.
    pub fn add(&mut self, event: &RunEventKind) -> Result<(), AnswerTooLarge> {
        self.used = self.used.saturating_add(accumulated_bytes(event));
        if self.used > self.limit {
            return Err(AnswerTooLarge {
                limit_bytes: self.limit,
            });
        }
        Ok(())
    }

    /// Bytes counted so far.
    pub fn used(&self) -> usize {
        self.used
    }
}

/// Bytes an event adds to an accumulated answer: its text, and a tool
/// call's id, name and argument bytes; nothing for the rest.
pub fn accumulated_bytes(event: &RunEventKind) -> usize {
    match event {
        RunEventKind::TextDelta(text) => text.len(),
        RunEventKind::ToolCallDelta(d) => {
            d.arguments_delta.len()
                + d.id.as_ref().map_or(0, String::len)
                + d.name.as_ref().map_or(0, String::len)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::ToolCallDelta;

    use super::*;

    #[test]
    fn an_answer_is_refused_only_once_it_holds_more_than_its_bound_r_lim_3() {
        let mut budget = WholeAnswerBudget::new(10);
        assert_eq!(budget.add(&RunEventKind::TextDelta("12345".into())), Ok(()));
        assert_eq!(budget.add(&RunEventKind::TextDelta("67890".into())), Ok(()));
        assert_eq!(budget.used(), 10, "exactly the bound is allowed");
        assert_eq!(
            budget.add(&RunEventKind::TextDelta("x".into())),
            Err(AnswerTooLarge { limit_bytes: 10 })
        );
    }

    #[test]
    fn a_rendering_is_charged_a_bounded_multiple_of_its_events_r_lim_6() {
        assert_eq!(rendering_bytes(0), 0);
        assert_eq!(rendering_bytes(1_000), 3_000);
        assert_eq!(rendering_bytes(u64::MAX), usize::MAX, "saturates");
    }

    #[test]
    fn tool_calls_count_their_id_name_and_arguments_r_lim_3() {
        let call = RunEventKind::ToolCallDelta(ToolCallDelta {
            index: 0,
            id: Some("id".into()),
            name: Some("fn".into()),
            arguments_delta: "{}".into(),
        });
        assert_eq!(accumulated_bytes(&call), 6);
        let mut budget = WholeAnswerBudget::new(11);
        assert_eq!(budget.add(&call), Ok(()));
        assert_eq!(budget.add(&call), Err(AnswerTooLarge { limit_bytes: 11 }));
        assert_eq!(
            WholeAnswerBudget::default().add(&RunEventKind::TextDelta("a".into())),
            Ok(()),
            "the default bound"
        );
    }
}
