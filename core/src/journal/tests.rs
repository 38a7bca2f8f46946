use proptest::prelude::*;

use super::*;

const NOW: u64 = 1_000_000;

fn limits() -> JournalLimits {
    JournalLimits {
        retention_ms: 60_000,
        max_bytes: 1 << 20,
        max_record_bytes: 1 << 16,
    }
}

fn new_record(id: &str, key: Option<&str>, body: &[u8]) -> NewRecord {
    NewRecord {
        id: id.into(),
        principal: "alice".into(),
        api: JournalApi::Responses,
        model: "m".into(),
        fingerprint: fingerprint("responses", body),
        idempotency_key: key.map(|k| idempotency_hash("alice", k)),
        background: false,
        request: body.to_vec(),
        created_unix_ms: NOW,
    }
}

fn created(new: &NewRecord) -> RecordMeta {
    match check_create(NOW, &limits(), 0, None, None, new).unwrap() {
        CreateOutcome::Create(meta) => meta,
        other => panic!("{other:?}"),
    }
}

fn ev(seq: u64) -> JournalEvent {
    JournalEvent {
        seq,
        payload: vec![b'x'; 10],
    }
}

fn done(status: RecordStatus) -> Terminal {
    Terminal {
        status,
        reason: None,
        message: None,
        at_unix_ms: NOW + 5,
    }
}

#[test]
fn a_new_record_starts_at_epoch_one_with_no_events_and_never_expires_while_running() {
    let meta = created(&new_record("r1", None, b"{}"));
    assert_eq!((meta.epoch, meta.last_seq, &meta.terminal), (1, 0, &None));
    assert!(!expired(&meta, u64::MAX), "R-JRN-5: running never expires");
}

#[test]
fn r_idem_1_same_key_same_body_is_the_existing_response_other_body_conflicts() {
    let first = created(&new_record("r1", Some("k"), b"{\"a\":1}"));
    let again = new_record("r2", Some("k"), b"{\"a\":1}");
    assert_eq!(
        check_create(NOW, &limits(), 0, None, Some(&first), &again),
        Ok(CreateOutcome::Existing(first.clone()))
    );
    let other = new_record("r3", Some("k"), b"{\"a\":2}");
    assert_eq!(
        check_create(NOW, &limits(), 0, None, Some(&first), &other),
        Err(JournalError::IdempotencyConflict)
    );
}

#[test]
fn r_idem_1_a_key_is_per_principal_and_stored_hashed() {
    assert_ne!(idempotency_hash("alice", "k"), idempotency_hash("bob", "k"));
    // The principal/key boundary is unambiguous.
    assert_ne!(idempotency_hash("ab", "c"), idempotency_hash("a", "bc"));
}

#[test]
fn r_idem_1_an_expired_response_frees_its_key() {
    let first = created(&new_record("r1", Some("k"), b"1"));
    let finished = check_finish(&limits(), &first, 1, &done(RecordStatus::Completed)).unwrap();
    let later = finished.expires_unix_ms;
    let other = new_record("r2", Some("k"), b"2");
    assert!(matches!(
        check_create(later, &limits(), 0, None, Some(&finished), &other),
        Ok(CreateOutcome::Create(_))
    ));
}

#[test]
fn r_idem_1_a_response_that_failed_before_any_event_frees_its_key() {
    let first = created(&new_record("r1", Some("k"), b"1"));
    let refused = check_finish(&limits(), &first, 1, &done(RecordStatus::Failed)).unwrap();
    let again = new_record("r2", Some("k"), b"1");
    assert!(superseded(&refused));
    assert!(matches!(
        check_create(NOW, &limits(), 0, None, Some(&refused), &again),
        Ok(CreateOutcome::Create(m)) if m.id == "r2"
    ));
    // Once an event was published the failure is the response.
    let started = check_append(&limits(), &first, 1, &[ev(1)]).unwrap();
    let failed = check_finish(&limits(), &started, 1, &done(RecordStatus::Failed)).unwrap();
    assert!(!superseded(&failed));
    assert!(matches!(
        check_create(NOW, &limits(), 0, None, Some(&failed), &again),
        Ok(CreateOutcome::Existing(m)) if m.id == "r1"
    ));
    // A cancelled one stays; one its Edge's restart ended before any event
    // gives way like a failed one.
    let cancelled = check_finish(&limits(), &first, 1, &done(RecordStatus::Cancelled)).unwrap();
    assert!(!superseded(&cancelled));
    let cut = check_finish(&limits(), &first, 1, &done(RecordStatus::Incomplete)).unwrap();
    assert!(superseded(&cut));
    let cut_later = check_finish(&limits(), &started, 1, &done(RecordStatus::Incomplete)).unwrap();
    assert!(!superseded(&cut_later));
}

#[test]
fn r_jrn_5_a_full_store_refuses_new_records() {
    let new = new_record("r1", None, b"body");
    let l = limits();
    assert_eq!(
        check_create(NOW, &l, l.max_bytes, None, None, &new),
        Err(JournalError::Full)
    );
    let too_big = new_record("r2", None, &vec![0; l.max_record_bytes as usize]);
    assert_eq!(
        check_create(NOW, &l, 0, None, None, &too_big),
        Err(JournalError::RecordTooLarge)
    );
}

#[test]
fn a_duplicate_id_is_refused() {
    let first = created(&new_record("r1", None, b"1"));
    assert_eq!(
        check_create(
            NOW,
            &limits(),
            0,
            Some(&first),
            None,
            &new_record("r1", None, b"1")
        ),
        Err(JournalError::DuplicateId)
    );
}

#[test]
fn r_jrn_2_appends_continue_the_numbering_without_gap_or_duplicate() {
    let meta = created(&new_record("r1", None, b"1"));
    let meta = check_append(&limits(), &meta, 1, &[ev(1), ev(2)]).unwrap();
    assert_eq!(meta.last_seq, 2);
    assert_eq!(
        check_append(&limits(), &meta, 1, &[ev(2)]),
        Err(JournalError::OutOfOrder {
            expected: 3,
            got: 2
        })
    );
    assert_eq!(
        check_append(&limits(), &meta, 1, &[ev(4)]),
        Err(JournalError::OutOfOrder {
            expected: 3,
            got: 4
        })
    );
    assert_eq!(
        check_append(&limits(), &meta, 1, &[ev(3), ev(5)]),
        Err(JournalError::OutOfOrder {
            expected: 4,
            got: 5
        })
    );
}

#[test]
fn r_jrn_3_a_fenced_writer_appends_nothing_not_even_a_terminal() {
    let meta = created(&new_record("r1", None, b"1"));
    let taken = check_raise_epoch(&meta, 1).unwrap();
    assert_eq!(taken.epoch, 2);
    let fenced = Err(JournalError::Fenced {
        current: 2,
        writer: 1,
    });
    assert_eq!(check_append(&limits(), &taken, 1, &[ev(1)]), fenced);
    assert_eq!(
        check_finish(&limits(), &taken, 1, &done(RecordStatus::Completed)),
        fenced
    );
    // The compare-and-set: a second takeover from the same epoch loses.
    assert_eq!(
        check_raise_epoch(&taken, 1),
        Err(JournalError::Fenced {
            current: 2,
            writer: 1
        })
    );
    assert!(check_append(&limits(), &taken, 2, &[ev(1)]).is_ok());
}

#[test]
fn r_jrn_4_one_terminal_and_nothing_after_it() {
    let meta = created(&new_record("r1", None, b"1"));
    let meta = check_finish(&limits(), &meta, 1, &done(RecordStatus::Completed)).unwrap();
    assert_eq!(meta.status(), RecordStatus::Completed);
    assert_eq!(meta.expires_unix_ms, NOW + 5 + limits().retention_ms);
    assert_eq!(
        check_finish(&limits(), &meta, 1, &done(RecordStatus::Failed)),
        Err(JournalError::Terminated)
    );
    assert_eq!(
        check_append(&limits(), &meta, 1, &[ev(1)]),
        Err(JournalError::Terminated)
    );
    assert_eq!(check_raise_epoch(&meta, 1), Err(JournalError::Terminated));
}

#[test]
fn an_in_progress_terminal_still_ends_the_record() {
    let meta = created(&new_record("r1", None, b"1"));
    let meta = check_finish(&limits(), &meta, 1, &done(RecordStatus::InProgress)).unwrap();
    assert_eq!(meta.status(), RecordStatus::Failed);
}

#[test]
fn a_record_cannot_grow_past_its_bound() {
    let l = limits();
    let meta = created(&new_record("r1", None, b"1"));
    let big = JournalEvent {
        seq: 1,
        payload: vec![0; l.max_record_bytes as usize],
    };
    assert_eq!(
        check_append(&l, &meta, 1, &[big]),
        Err(JournalError::RecordTooLarge)
    );
}

#[test]
fn limits_are_validated_by_field() {
    assert!(JournalLimits::default().validate().is_ok());
    let l = JournalLimits {
        retention_ms: 10,
        ..JournalLimits::default()
    };
    assert!(
        l.validate()
            .unwrap_err()
            .to_string()
            .contains("retention_ms")
    );
    let l = JournalLimits {
        max_bytes: 1,
        ..JournalLimits::default()
    };
    assert!(l.validate().unwrap_err().to_string().contains("max_bytes"));
    let l = JournalLimits {
        max_record_bytes: 1,
        ..JournalLimits::default()
    };
    assert!(
        l.validate()
            .unwrap_err()
            .to_string()
            .contains("max_record_bytes")
    );
}

#[test]
fn r_jrn_1_group_commit_batches_what_arrives_during_a_sync() {
    let mut g = GroupCommit::new(100, 10, 1 << 20);
    g.submit(Ticket(1), "a", 1).unwrap();
    let batch = g.poll_batch().unwrap();
    assert_eq!(batch, vec![(Ticket(1), "a")]);
    // While the sync runs, more arrive; none goes out alone.
    for i in 2..=5 {
        g.submit(Ticket(i), "b", 1).unwrap();
        assert!(g.poll_batch().is_none());
    }
    g.synced();
    let batch = g.poll_batch().unwrap();
    assert_eq!(batch.len(), 4, "one sync for four appends");
    g.synced();
    assert!(g.poll_batch().is_none());
}

#[test]
fn group_commit_is_bounded_in_queue_and_batch() {
    let mut g = GroupCommit::new(3, 2, 10);
    for i in 0..3 {
        g.submit(Ticket(i), i, 6).unwrap();
    }
    assert_eq!(g.submit(Ticket(9), 9, 1), Err(QueueFull), "R-LIM-4");
    // 6 + 6 > 10 bytes: the batch stops after the first.
    assert_eq!(g.poll_batch().unwrap().len(), 1);
    g.synced();
    assert_eq!(g.queued(), 2);
    assert_eq!(g.queued_bytes(), 12);
}

#[derive(Debug, Clone)]
enum Op {
    Append { epoch: u64, seq: u64 },
    Finish { epoch: u64 },
    Raise { expected: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..4, 0u64..12).prop_map(|(epoch, seq)| Op::Append { epoch, seq }),
        1 => (1u64..4).prop_map(|epoch| Op::Finish { epoch }),
        1 => (1u64..4).prop_map(|expected| Op::Raise { expected }),
    ]
}

proptest! {
    /// R-JRN-2/3/4 over any sequence of operations: the accepted events are
    /// 1..=n, each accepted by the epoch current at the time, and nothing
    /// is accepted after the one terminal.
    #[test]
    fn accepted_history_is_gapless_fenced_and_ends_once(ops in proptest::collection::vec(op(), 0..60)) {
        let l = limits();
        let mut meta = created(&new_record("r", None, b"1"));
        let mut accepted = Vec::new();
        let mut terminals = 0;
        for op in ops {
            let before = meta.clone();
            let result = match op {
                Op::Append { epoch, seq } => check_append(&l, &meta, epoch, &[ev(seq)]).map(|m| (m, Some((epoch, seq)))),
                Op::Finish { epoch } => check_finish(&l, &meta, epoch, &done(RecordStatus::Completed)).map(|m| (m, None)),
                Op::Raise { expected } => check_raise_epoch(&meta, expected).map(|m| (m, None)),
            };
            if let Ok((next, appended)) = result {
                if let Some((epoch, seq)) = appended {
                    prop_assert_eq!(epoch, before.epoch);
                    prop_assert!(before.terminal.is_none());
                    accepted.push(seq);
                }
                if next.terminal.is_some() && before.terminal.is_none() {
                    terminals += 1;
                }
                meta = next;
            } else {
                prop_assert_eq!(&meta, &before);
            }
        }
        prop_assert!(terminals <= 1);
        let expected: Vec<u64> = (1..=accepted.len() as u64).collect();
        prop_assert_eq!(accepted, expected);
    }
}
