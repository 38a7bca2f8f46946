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
        owner: "edge-a".into(),
        key_id: "key-a".into(),
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
    assert_eq!(meta.owner, "edge-a", "its creator owns it");
    assert!(!expired(&meta, u64::MAX), "R-JRN-5: running never expires");
}

#[test]
fn r_ten_1_a_record_names_its_key_and_holds_its_bytes_and_while_running_in_background_one_response()
{
    let mut new = new_record("r1", None, b"{}");
    new.background = true;
    let meta = created(&new);
    assert_eq!(meta.key_id, "key-a", "the key that asked");
    let held = |m: &RecordMeta| (m.held().journal_bytes, m.held().background);
    assert_eq!(held(&meta), (meta.stored_bytes, 1));
    let grown = check_append(&limits(), &meta, 1, &[ev(1)]).unwrap();
    assert_eq!(
        held(&grown),
        (meta.stored_bytes + 10 + EVENT_OVERHEAD_BYTES, 1)
    );
    let ended = check_finish(&limits(), &grown, 1, &done(RecordStatus::Completed)).unwrap();
    assert_eq!(held(&ended), (grown.stored_bytes, 0), "a terminal ends it");
    let foreground = created(&new_record("r2", None, b"{}"));
    assert_eq!(held(&foreground).1, 0);
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
    let taken = check_raise_epoch(&meta, 1, "edge-b").unwrap();
    assert_eq!(taken.epoch, 2);
    assert_eq!(taken.owner, "edge-b", "the winner owns it");
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
        check_raise_epoch(&taken, 1, "edge-c"),
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
    assert_eq!(
        check_raise_epoch(&meta, 1, "edge-b"),
        Err(JournalError::Terminated)
    );
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
fn limits_are_accepted_exactly_at_their_bounds() {
    let ok = |l: JournalLimits| l.validate().is_ok();
    let base = JournalLimits::default();
    let year = 365 * 24 * 60 * 60 * 1000;
    for (retention_ms, valid) in [(999, false), (1000, true), (year, true), (year + 1, false)] {
        assert_eq!(
            ok(JournalLimits {
                retention_ms,
                ..base
            }),
            valid,
            "retention_ms {retention_ms}"
        );
    }
    for (max_record_bytes, valid) in [(65_535, false), (65_536, true)] {
        assert_eq!(
            ok(JournalLimits {
                max_record_bytes,
                max_bytes: max_record_bytes,
                ..base
            }),
            valid,
            "max_record_bytes {max_record_bytes}"
        );
    }
    assert!(ok(JournalLimits {
        max_bytes: base.max_record_bytes,
        ..base
    }));
    assert_eq!(
        JournalLimits {
            max_bytes: base.max_record_bytes - 1,
            ..base
        }
        .validate(),
        Err(JournalLimitsError::MaxBytes {
            max_bytes: base.max_record_bytes - 1,
            max_record_bytes: base.max_record_bytes
        })
    );
}

#[test]
fn records_and_events_count_their_bytes_and_fit_exactly_at_the_bounds_r_jrn_5() {
    let l = limits();
    assert_eq!(event_bytes(&ev(1)), 10 + EVENT_OVERHEAD_BYTES);
    let meta = created(&new_record("r1", None, b"12345"));
    assert_eq!(meta.stored_bytes, 5 + RECORD_OVERHEAD_BYTES);
    // A request that fills the record bound exactly is accepted; one byte
    // more is not.
    let fits = (l.max_record_bytes - RECORD_OVERHEAD_BYTES) as usize;
    for (len, result) in [(fits, true), (fits + 1, false)] {
        let outcome = check_create(
            NOW,
            &l,
            0,
            None,
            None,
            &new_record("r", None, &vec![b'x'; len]),
        );
        assert_eq!(outcome.is_ok(), result, "request of {len} bytes");
    }
    // A store filled exactly by the new record accepts it.
    let small = new_record("r2", None, b"1");
    let bytes = 1 + RECORD_OVERHEAD_BYTES;
    assert!(check_create(NOW, &l, l.max_bytes - bytes, None, None, &small).is_ok());
    assert_eq!(
        check_create(NOW, &l, l.max_bytes - bytes + 1, None, None, &small),
        Err(JournalError::Full)
    );
    // An append that fills the record bound exactly is accepted.
    let room = l.max_record_bytes - meta.stored_bytes - EVENT_OVERHEAD_BYTES;
    let event = |len: u64| JournalEvent {
        seq: 1,
        payload: vec![0; len as usize],
    };
    let next = check_append(&l, &meta, 1, &[event(room)]).unwrap();
    assert_eq!(next.stored_bytes, l.max_record_bytes);
    assert_eq!(
        check_append(&l, &meta, 1, &[event(room + 1)]),
        Err(JournalError::RecordTooLarge)
    );
}

#[test]
fn the_closed_names_are_the_documented_ones() {
    let apis = [
        (JournalApi::Responses, "responses"),
        (JournalApi::ChatCompletions, "chat"),
        (JournalApi::Completions, "completions"),
        (JournalApi::OllamaChat, "ollama_chat"),
        (JournalApi::OllamaGenerate, "ollama_generate"),
        (JournalApi::Embeddings, "embeddings"),
        (JournalApi::OllamaEmbed, "ollama_embed"),
        (JournalApi::Messages, "messages"),
    ];
    for (api, name) in apis {
        assert_eq!(api.as_str(), name);
    }
    // The Responses API's spelling of each status.
    let statuses = [
        (RecordStatus::InProgress, "in_progress"),
        (RecordStatus::Completed, "completed"),
        (RecordStatus::Incomplete, "incomplete"),
        (RecordStatus::Failed, "failed"),
        (RecordStatus::Cancelled, "cancelled"),
    ];
    for (status, name) in statuses {
        assert_eq!(status.as_str(), name);
        assert_eq!(status.is_terminal(), status != RecordStatus::InProgress);
    }
    let errors = [
        JournalError::NotFound,
        JournalError::Fenced {
            current: 2,
            writer: 1,
        },
        JournalError::Terminated,
        JournalError::OutOfOrder {
            expected: 1,
            got: 2,
        },
        JournalError::IdempotencyConflict,
        JournalError::DuplicateId,
        JournalError::Full,
        JournalError::RecordTooLarge,
        JournalError::Store("x".into()),
        JournalError::Unavailable(availability::StoreState::Connecting),
        JournalError::Backlog,
    ];
    let names: Vec<&str> = errors.iter().map(JournalError::as_str).collect();
    assert_eq!(names, JournalError::NAMES);
    let leases = [
        (LeaseState::Renewing, "renewing"),
        (LeaseState::Unconfirmed, "unconfirmed"),
        (LeaseState::Expired, "expired"),
    ];
    for (state, name) in leases {
        assert_eq!(state.as_str(), name);
    }
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
    assert_eq!(g.submit(Ticket(9), 9, 1), Err(QueueFull::Queue), "R-LIM-4");
    // 6 + 6 > 10 bytes: the batch stops after the first.
    assert_eq!(g.poll_batch().unwrap().len(), 1);
    g.synced();
    assert_eq!(g.queued(), 2);
    assert_eq!(g.queued_bytes(), 12);
    // A batch that fills the byte bound exactly takes both.
    let mut g = GroupCommit::new(4, 4, 12);
    for i in 0..3 {
        g.submit(Ticket(i), i, 6).unwrap();
    }
    assert_eq!(g.poll_batch().unwrap().len(), 2);
    g.synced();
    assert_eq!(g.queued_bytes(), 6);
}

#[test]
fn one_principals_burst_takes_only_its_share_of_the_write_queue_r_ten_1() {
    // A queue of 8, each principal at most 3 of it.
    let mut g = GroupCommit::new(8, 8, 1 << 20).with_share_bound(3);
    let (burst, other) = (write_share("burst"), write_share("other"));
    assert_ne!(burst, other);
    let mut ticket = 0;
    let mut submit = |g: &mut GroupCommit<&str>, share: Option<u64>| {
        ticket += 1;
        g.submit_as(Ticket(ticket), "op", 1, share)
    };
    for _ in 0..3 {
        submit(&mut g, Some(burst)).unwrap();
    }
    for _ in 0..5 {
        assert_eq!(submit(&mut g, Some(burst)), Err(QueueFull::Share));
    }
    assert_eq!(g.queued_for(burst), 3);
    // The others still find room, up to the whole queue's bound.
    for _ in 0..3 {
        submit(&mut g, Some(other)).unwrap();
    }
    submit(&mut g, None).unwrap();
    submit(&mut g, None).unwrap();
    assert_eq!(submit(&mut g, None), Err(QueueFull::Queue));
    // Once its operations went to the writer, the share has room again.
    assert_eq!(g.poll_batch().unwrap().len(), 8);
    assert_eq!((g.queued_for(burst), g.queued_for(other)), (0, 0));
    g.synced();
    submit(&mut g, Some(burst)).unwrap();
}

fn ms(n: u64) -> Instant {
    Instant::from_millis(n)
}

fn lease(edge: &str, revision: u64, ttl_ms: u64) -> StoredLease {
    StoredLease {
        revision,
        lease: EdgeLease {
            edge_id: edge.into(),
            incarnation: 7,
            ttl_ms,
            renewed_unix_ms: NOW,
        },
    }
}

#[test]
fn a_lease_write_replaces_only_the_revision_it_read() {
    assert_eq!(check_put_lease(None, 0), Ok(()));
    let stored = lease("a", 5, 3_000);
    assert_eq!(check_put_lease(Some(&stored), 5), Ok(()));
    assert_eq!(
        check_put_lease(Some(&stored), 4),
        Err(JournalError::Fenced {
            current: 5,
            writer: 4
        })
    );
    assert_eq!(
        check_put_lease(None, 5),
        Err(JournalError::Fenced {
            current: 0,
            writer: 5
        }),
        "a lease gone from the store is not ours to renew blindly"
    );
    assert_eq!(stored.lease.renew_interval(), Duration::from_secs(1));
    let silly = lease("a", 1, 1);
    assert_eq!(silly.lease.ttl(), Duration::from_millis(MIN_LEASE_TTL_MS));
}

#[test]
fn r_take_1_a_lease_expires_only_after_its_ttl_without_a_change_on_the_observers_clock() {
    let mut view = LeaseView::new(Duration::from_secs(10));
    assert_eq!(view.state("a", ms(0)), None, "never read");
    view.observe("a", Some(&lease("a", 5, 3_000)), ms(1_000));
    // First seen: not yet known to renew, and not observed for a TTL.
    assert_eq!(view.state("a", ms(3_999)), Some(LeaseState::Unconfirmed));
    view.observe("a", Some(&lease("a", 9, 3_000)), ms(2_000));
    assert_eq!(view.state("a", ms(4_999)), Some(LeaseState::Renewing));
    // The same revision read again does not restart its clock.
    view.observe("a", Some(&lease("a", 9, 3_000)), ms(4_000));
    assert_eq!(view.state("a", ms(5_000)), Some(LeaseState::Expired));
    // A renewal brings it back.
    view.observe("a", Some(&lease("a", 12, 3_000)), ms(6_000));
    assert_eq!(view.state("a", ms(6_001)), Some(LeaseState::Renewing));
}

#[test]
fn r_take_1_a_failed_read_restarts_every_clock_so_an_outage_is_not_a_death() {
    let mut view = LeaseView::new(Duration::from_secs(10));
    view.observe("a", Some(&lease("a", 5, 3_000)), ms(0));
    // The store was out from 1 s to 20 s: nobody could renew.
    view.read_failed(ms(20_000));
    view.observe("a", Some(&lease("a", 5, 3_000)), ms(21_000));
    assert_eq!(view.state("a", ms(21_000)), Some(LeaseState::Unconfirmed));
    assert_eq!(view.state("a", ms(22_999)), Some(LeaseState::Unconfirmed));
    assert_eq!(view.state("a", ms(23_000)), Some(LeaseState::Expired));
}

#[test]
fn r_take_1_an_absent_lease_expires_after_the_observers_ttl() {
    let mut view = LeaseView::new(Duration::from_secs(10));
    view.observe("gone", None, ms(0));
    assert_eq!(view.state("gone", ms(9_999)), Some(LeaseState::Unconfirmed));
    assert_eq!(view.state("gone", ms(10_000)), Some(LeaseState::Expired));
    // A listing without an Edge it followed: that lease is gone now, and
    // judged by the TTL it had.
    view.observe_all(&[lease("a", 1, 3_000)], ms(0));
    view.observe_all(&[], ms(1_000));
    assert_eq!(view.state("a", ms(3_999)), Some(LeaseState::Unconfirmed));
    assert_eq!(view.state("a", ms(4_000)), Some(LeaseState::Expired));
    let peers = view.peers(ms(4_000));
    assert_eq!(peers.len(), 2);
    assert!(peers.iter().all(|p| p.lease.is_none()), "{peers:?}");
}

#[test]
fn a_lease_view_follows_a_bounded_number_of_edges() {
    let mut view = LeaseView::new(Duration::from_secs(1));
    for i in 0..MAX_TRACKED_EDGES + 5 {
        view.observe(&format!("e{i}"), None, ms(0));
    }
    assert_eq!(view.peers(ms(0)).len(), MAX_TRACKED_EDGES);
    let extra = format!("e{}", MAX_TRACKED_EDGES + 1);
    assert_eq!(
        view.state(&extra, ms(u64::MAX / 2_000)),
        None,
        "not followed: never expired"
    );
}

fn owned_by(owner: &str) -> RecordMeta {
    let mut meta = created(&new_record("r1", None, b"1"));
    meta.owner = owner.into();
    meta
}

#[test]
fn r_take_1_orphans_are_this_edges_unrun_records_and_those_of_expired_owners() {
    let mine = owned_by("edge-a");
    assert_eq!(
        orphan(&mine, "edge-a", false, None),
        Some(Orphan::EdgeRestart)
    );
    assert_eq!(orphan(&mine, "edge-a", true, None), None, "running here");
    assert_eq!(
        orphan(&owned_by(NO_OWNER), "edge-a", false, None),
        Some(Orphan::EdgeRestart),
        "stored before owners were recorded: this store's one Edge"
    );
    let theirs = owned_by("edge-b");
    for alive in [
        None,
        Some(LeaseState::Unconfirmed),
        Some(LeaseState::Renewing),
    ] {
        assert_eq!(
            orphan(&theirs, "edge-a", false, alive),
            None,
            "a live Edge's record is never taken: {alive:?}"
        );
    }
    assert_eq!(
        orphan(&theirs, "edge-a", false, Some(LeaseState::Expired)),
        Some(Orphan::EdgeLost)
    );
    let ended = check_finish(&limits(), &theirs, 1, &done(RecordStatus::Completed)).unwrap();
    assert_eq!(
        orphan(&ended, "edge-a", false, Some(LeaseState::Expired)),
        None
    );
    assert_eq!(Orphan::EdgeRestart.reason(), EDGE_RESTART_REASON);
    assert_eq!(Orphan::EdgeLost.reason(), EDGE_LOST_REASON);
}

#[test]
fn r_take_1_an_orphan_waits_the_park_window_then_ends() {
    let window = Duration::from_secs(35);
    let mut scan = TakeoverScan::new("edge-a", window, Duration::from_secs(15));
    let mine = owned_by("edge-a");
    assert_eq!(
        scan.decide(&mine, false, ms(0)),
        TakeoverDecision::Wait { until: ms(35_000) }
    );
    assert_eq!(scan.poll_timeout(), Some(ms(35_000)));
    assert!(scan.is_waiting("r1"));
    assert_eq!(
        scan.decide(&mine, false, ms(34_999)),
        TakeoverDecision::Wait { until: ms(35_000) },
        "the window counts from when it was first found"
    );
    assert_eq!(
        scan.decide(&mine, false, ms(35_000)),
        TakeoverDecision::End(Orphan::EdgeRestart)
    );
    // Adopted meanwhile (a run of this Edge writes it now): kept, forgotten.
    assert_eq!(scan.decide(&mine, true, ms(35_000)), TakeoverDecision::Keep);
    assert_eq!(scan.waiting(), 0);
    assert_eq!(scan.poll_timeout(), None);
    scan.decide(&mine, false, ms(40_000));
    scan.retain(|_| false);
    assert_eq!(
        scan.waiting(),
        0,
        "retain bounds it to the records passed in"
    );
}

#[test]
fn r_take_1_a_forgotten_orphan_waits_a_whole_window_again() {
    let window = Duration::from_secs(35);
    let mut scan = TakeoverScan::new("edge-a", window, Duration::from_secs(15));
    let mine = owned_by("edge-a");
    assert!(!scan.is_waiting("r1"));
    scan.decide(&mine, false, ms(0));
    assert_eq!(scan.waiting(), 1);
    assert!(scan.is_waiting("r1"));
    assert!(!scan.is_waiting("r2"));
    scan.forget("r2");
    assert_eq!(
        scan.waiting(),
        1,
        "forgetting another record changes nothing"
    );
    scan.forget("r1");
    assert_eq!(scan.waiting(), 0);
    assert!(!scan.is_waiting("r1"));
    assert_eq!(
        scan.decide(&mine, false, ms(30_000)),
        TakeoverDecision::Wait { until: ms(65_000) },
        "found again: its window starts again"
    );
}

#[test]
fn r_take_1_a_dead_edges_record_waits_from_its_expiry_and_an_edge_that_returns_keeps_it() {
    let mut scan = TakeoverScan::new("edge-a", Duration::from_secs(35), Duration::from_secs(15));
    let theirs = owned_by("edge-b");
    scan.leases_mut()
        .observe("edge-b", Some(&lease("edge-b", 3, 15_000)), ms(0));
    assert_eq!(
        scan.decide(&theirs, false, ms(14_999)),
        TakeoverDecision::Keep
    );
    assert_eq!(
        scan.decide(&theirs, false, ms(15_000)),
        TakeoverDecision::Wait { until: ms(50_000) }
    );
    // It renews again before the window ends: its record stays its own.
    scan.leases_mut()
        .observe("edge-b", Some(&lease("edge-b", 4, 15_000)), ms(20_000));
    assert_eq!(
        scan.decide(&theirs, false, ms(20_001)),
        TakeoverDecision::Keep
    );
    assert_eq!(scan.waiting(), 0);
    // Dead for good: a new window from the new expiry.
    assert_eq!(
        scan.decide(&theirs, false, ms(35_000)),
        TakeoverDecision::Wait { until: ms(70_000) }
    );
    assert_eq!(
        scan.decide(&theirs, false, ms(70_000)),
        TakeoverDecision::End(Orphan::EdgeLost)
    );
    assert_eq!(scan.me(), "edge-a");
}

#[test]
fn r_take_1_on_a_store_of_its_own_every_unrun_record_is_this_edges() {
    let mut scan = TakeoverScan::sole("edge-a", Duration::from_secs(1));
    assert!(scan.is_sole());
    // Written under another edge_id by an earlier run of this Edge.
    let renamed = owned_by("old-name");
    assert_eq!(
        scan.decide(&renamed, false, ms(0)),
        TakeoverDecision::Wait { until: ms(1_000) }
    );
    assert_eq!(
        scan.decide(&renamed, false, ms(1_000)),
        TakeoverDecision::End(Orphan::EdgeRestart)
    );
    assert_eq!(
        scan.decide(&renamed, true, ms(2_000)),
        TakeoverDecision::Keep
    );
    assert!(!TakeoverScan::new("edge-a", Duration::ZERO, Duration::from_secs(1)).is_sole());
}

#[test]
fn r_take_1_a_takeover_race_has_one_winner() {
    let theirs = owned_by("edge-b");
    let won = check_raise_epoch(&theirs, theirs.epoch, "edge-a").unwrap();
    assert_eq!(
        check_raise_epoch(&won, theirs.epoch, "edge-c"),
        Err(JournalError::Fenced {
            current: 2,
            writer: 1
        })
    );
    // The winner is the live owner now: no other Edge takes it.
    let mut scan = TakeoverScan::new("edge-c", Duration::ZERO, Duration::from_secs(15));
    scan.leases_mut()
        .observe("edge-a", Some(&lease("edge-a", 8, 15_000)), ms(0));
    assert_eq!(scan.decide(&won, false, ms(1)), TakeoverDecision::Keep);
}

proptest! {
    /// R-TAKE-1: an Edge that renews within its TTL is never seen
    /// expired, however the observer's reads fall and fail.
    #[test]
    fn a_lease_renewed_within_its_ttl_never_reads_expired(
        gaps in proptest::collection::vec(1u64..3_000, 1..40),
        reads in proptest::collection::vec((0u64..60_000, proptest::bool::ANY), 1..80),
    ) {
        let ttl_ms = 3_000;
        let mut writes = Vec::new();
        let mut at = 0;
        for gap in gaps {
            at += gap;
            writes.push(at);
        }
        let last_write = *writes.last().unwrap_or(&0);
        let mut reads = reads;
        reads.sort();
        let mut view = LeaseView::new(Duration::from_millis(ttl_ms));
        for (t, fails) in reads {
            if t > last_write {
                break;
            }
            if fails {
                view.read_failed(ms(t));
                continue;
            }
            let revision = writes.iter().filter(|w| **w <= t).count() as u64;
            let read = (revision > 0).then(|| lease("a", revision, ttl_ms));
            view.observe("a", read.as_ref(), ms(t));
            if revision > 0 {
                prop_assert_ne!(view.state("a", ms(t)), Some(LeaseState::Expired));
            }
        }
    }
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
                Op::Raise { expected } => check_raise_epoch(&meta, expected, "edge-b").map(|m| (m, None)),
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

#[test]
fn r_take_2_a_lease_that_moves_while_a_starting_edge_watches_it_is_in_use() {
    // TTL 3 s: renewed every second, watched for two.
    let mut claim = LeaseClaim::new(Some(&lease("a", 5, 3_000)), ms(0), true);
    assert_eq!(claim.watch_until(), ms(2_000));
    assert_eq!(claim.verdict(ms(500)), None);
    claim.observe(Some(&lease("a", 5, 3_000)), ms(500));
    assert_eq!(claim.verdict(ms(999)), None);
    claim.observe(Some(&lease("a", 6, 3_000)), ms(1_000));
    assert_eq!(
        claim.verdict(ms(1_000)),
        Some(ClaimVerdict::InUse {
            holder: lease("a", 6, 3_000).lease
        })
    );
    // Still in use after the watch: a moving lease is never taken.
    assert!(matches!(
        claim.verdict(ms(5_000)),
        Some(ClaimVerdict::InUse { .. })
    ));
}

#[test]
fn r_take_2_a_crashed_edges_lease_is_taken_after_two_renewal_intervals_within_its_ttl() {
    let mut claim = LeaseClaim::new(Some(&lease("a", 5, 3_000)), ms(0), true);
    claim.observe(Some(&lease("a", 5, 3_000)), ms(1_999));
    assert_eq!(claim.verdict(ms(1_999)), None);
    assert_eq!(
        claim.verdict(ms(2_000)),
        Some(ClaimVerdict::Take {
            expected_revision: 5
        })
    );
    assert!(claim.watch_until() < ms(3_000), "within one TTL");
}

#[test]
fn r_take_2_no_lease_or_an_exclusive_store_is_taken_at_once() {
    let claim = LeaseClaim::new(None, ms(0), true);
    assert_eq!(
        claim.verdict(ms(0)),
        Some(ClaimVerdict::Take {
            expected_revision: 0
        })
    );
    let claim = LeaseClaim::new(Some(&lease("a", 5, 3_000)), ms(0), false);
    assert_eq!(
        claim.verdict(ms(0)),
        Some(ClaimVerdict::Take {
            expected_revision: 5
        })
    );
    // A lease removed while watched: nobody holds it.
    let mut claim = LeaseClaim::new(Some(&lease("a", 5, 3_000)), ms(0), true);
    claim.observe(None, ms(100));
    assert_eq!(
        claim.verdict(ms(2_000)),
        Some(ClaimVerdict::Take {
            expected_revision: 0
        })
    );
}

proptest! {
    #[test]
    fn r_take_2_a_claim_is_in_use_exactly_when_a_read_saw_another_revision(
        first in 1u64..100,
        reads in proptest::collection::vec((0u64..3, 1u64..2_000), 0..8),
    ) {
        let mut claim = LeaseClaim::new(Some(&lease("a", first, 3_000)), ms(0), true);
        let mut at = 0;
        let mut moved = false;
        for (step, dt) in reads {
            at += dt;
            let read = (step > 0).then(|| lease("a", first + step - 1, 3_000));
            moved |= read.as_ref().is_some_and(|l| l.revision != first);
            claim.observe(read.as_ref(), ms(at));
        }
        let verdict = claim.verdict(ms(at.max(2_000)));
        prop_assert_eq!(matches!(verdict, Some(ClaimVerdict::InUse { .. })), moved);
        prop_assert!(verdict.is_some(), "decided once watched");
    }
}
