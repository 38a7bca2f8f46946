//! The custody machine against a small model of the store: records,
//! events and leases, every write decided by the journal's `check_*`
//! functions as a real store decides it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use iop_wire::{RunEventKind, RunKey, ToolCallDelta};

use super::*;
use crate::edge::delivery::Delivery;
use crate::edge::durable::{FrameSource, encode_entry};
use crate::ids::ProviderId;
use crate::journal::{
    EdgeLease, Fingerprint, JournalApi, JournalLimits, check_finish, check_raise_epoch,
};

const ME: &str = "edge-a";
const PEER: &str = "edge-b";
const WINDOW: Duration = Duration::from_secs(30);

fn ms(v: u64) -> Instant {
    Instant::from_millis(v)
}

fn config(sole: bool) -> CustodyConfig {
    CustodyConfig {
        edge_id: ME.into(),
        park_window: WINDOW,
        lease_ttl: Duration::from_secs(3),
        sole,
        scan_interval: Duration::from_secs(1),
        max_tasks: MAX_TASKS,
    }
}

fn record(id: &str, owner: &str) -> RecordMeta {
    RecordMeta {
        id: id.into(),
        principal: "p".into(),
        api: JournalApi::ChatCompletions,
        model: "m".into(),
        fingerprint: Fingerprint::default(),
        idempotency_key: None,
        background: false,
        created_unix_ms: 1,
        epoch: 1,
        last_seq: 0,
        terminal: None,
        expires_unix_ms: u64::MAX,
        stored_bytes: 0,
        owner: owner.into(),
        key_id: "k".into(),
    }
}

fn key() -> RunKey {
    RunKey {
        generation: 7,
        run_id: 3,
    }
}

fn text_event(text: &str, frame: u64) -> Vec<u8> {
    encode_entry(
        &Delivery::Event(RunEventKind::TextDelta(text.into())),
        Some(FrameSource {
            key: key(),
            frame,
            provider_id: ProviderId::from("p1"),
        }),
    )
}

fn offer(id: &str) -> ParkedOffer {
    ParkedOffer {
        run: iop_wire::ParkedRun {
            key: key(),
            response_id: id.into(),
            adapter: iop_wire::AdapterKind::Mock,
            target: "m".into(),
            first_kept_frame: 1,
            last_frame: 9,
            ended: false,
        },
        provider_id: ProviderId::from("p1"),
        node: crate::ids::NodeId::from("n"),
    }
}

/// The store as the custody sees it, and what else the Edge knows.
#[derive(Default)]
struct Store {
    records: BTreeMap<String, (RecordMeta, Vec<JournalEvent>)>,
    leases: BTreeMap<String, StoredLease>,
    /// Records a run of this Edge writes.
    live: BTreeSet<String>,
    continuable: bool,
    /// Operations answered with a store failure, once each, by kind.
    fail_next: Vec<&'static str>,
    /// Every read of one record fails (an outage the scans' listing
    /// outlives).
    records_fail: bool,
    /// Before answering a raise, another writer raises first (once).
    beaten_by: Option<String>,
    ops: Vec<StoreOp>,
}

impl Store {
    fn add(&mut self, meta: RecordMeta, texts: &[&str]) {
        let mut meta = meta;
        let events: Vec<JournalEvent> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| JournalEvent {
                seq: i as u64 + 1,
                payload: text_event(t, i as u64 + 1),
            })
            .collect();
        meta.last_seq = events.len() as u64;
        self.records.insert(meta.id.clone(), (meta, events));
    }

    fn lease(&mut self, edge_id: &str, revision: u64) {
        self.leases.insert(
            edge_id.into(),
            StoredLease {
                revision,
                lease: EdgeLease {
                    edge_id: edge_id.into(),
                    incarnation: 1,
                    ttl_ms: 3_000,
                    renewed_unix_ms: 0,
                },
            },
        );
    }

    fn fails(&mut self, kind: &'static str) -> bool {
        if let Some(i) = self.fail_next.iter().position(|k| *k == kind) {
            self.fail_next.remove(i);
            return true;
        }
        false
    }

    fn answer(&mut self, op: StoreOp) -> StoreAnswer {
        self.ops.push(op.clone());
        let failed = || JournalError::Store("disk".into());
        match op {
            StoreOp::Unfinished { .. } => StoreAnswer::Unfinished(Ok(self
                .records
                .values()
                .filter(|(m, _)| m.terminal.is_none())
                .map(|(m, _)| (m.clone(), self.live.contains(&m.id)))
                .collect())),
            StoreOp::Leases => StoreAnswer::Leases(Ok(self.leases.values().cloned().collect())),
            StoreOp::Lease { edge_id } => StoreAnswer::Lease {
                result: Ok(self.leases.get(&edge_id).cloned()),
                edge_id,
            },
            StoreOp::Record { id } => StoreAnswer::Record {
                result: if self.records_fail || self.fails("record") {
                    Err(failed())
                } else {
                    Ok(self.records.get(&id).map(|(m, _)| m.clone()))
                },
                live_here: self.live.contains(&id),
                continuable: self.continuable,
                id,
            },
            StoreOp::Event { id, seq } => StoreAnswer::Event {
                result: Ok(self
                    .records
                    .get(&id)
                    .and_then(|(_, e)| e.iter().find(|e| e.seq == seq).map(|e| e.payload.clone()))),
                id,
            },
            StoreOp::Events { id } => StoreAnswer::Events {
                result: if self.fails("events") {
                    Err(failed())
                } else {
                    Ok(self
                        .records
                        .get(&id)
                        .map(|(_, e)| e.clone())
                        .unwrap_or_default())
                },
                id,
            },
            StoreOp::RaiseEpoch { id, expected } => {
                if let Some(other) = self.beaten_by.take() {
                    let (meta, _) = self.records.get_mut(&id).expect("record");
                    let epoch = meta.epoch;
                    *meta = check_raise_epoch(meta, epoch, &other).expect("other raise");
                }
                let result = if self.fails("raise") {
                    Err(failed())
                } else {
                    match self.records.get_mut(&id) {
                        None => Err(JournalError::NotFound),
                        Some((meta, _)) => check_raise_epoch(meta, expected, ME).inspect(|m| {
                            *meta = m.clone();
                        }),
                    }
                };
                StoreAnswer::Raised { id, result }
            }
            StoreOp::Finish {
                id,
                epoch,
                terminal,
            } => {
                let result = if self.fails("finish") {
                    Err(failed())
                } else {
                    match self.records.get_mut(&id) {
                        None => Err(JournalError::NotFound),
                        Some((meta, _)) => {
                            check_finish(&JournalLimits::default(), meta, epoch, &terminal)
                                .map(|m| *meta = m)
                        }
                    }
                };
                StoreAnswer::Finished { id, result }
            }
        }
    }
}

/// Drain the custody, answering every store operation at once; the other
/// outputs are returned.
fn drive(custody: &mut Custody, store: &mut Store, now: Instant) -> Vec<CustodyOutput> {
    let mut seen = Vec::new();
    for _ in 0..10_000 {
        let Some(out) = custody.poll_output() else {
            return seen;
        };
        match out {
            CustodyOutput::Store(op) => {
                let answer = store.answer(op);
                custody.handle_input(now, CustodyInput::Store(answer));
            }
            other => seen.push(other),
        }
    }
    panic!("the custody did not settle");
}

fn tick(custody: &mut Custody, store: &mut Store, now: Instant) -> Vec<CustodyOutput> {
    custody.handle_timeout(now);
    drive(custody, store, now)
}

fn ended(outputs: &[CustodyOutput]) -> Vec<(&str, &'static str)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Event(CustodyEvent::Ended { id, reason, .. }) => {
                Some((id.as_str(), *reason))
            }
            _ => None,
        })
        .collect()
}

/// The adoptions among `outputs`: (epoch, resume after frame, whether
/// the answer so far came with it).
fn adopted(outputs: &[CustodyOutput]) -> Vec<(u64, u64, bool)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Adopt {
                meta,
                resume_after_frame,
                resumed,
                ..
            } => Some((meta.epoch, *resume_after_frame, resumed.is_some())),
            _ => None,
        })
        .collect()
}

fn status(store: &Store, id: &str) -> RecordStatus {
    store.records[id].0.status()
}

#[test]
fn r_take_1_an_orphan_waits_its_park_window_then_ends_incomplete_fenced() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["Hel"]);
    let mut custody = Custody::new(ms(0), config(true));
    let out = tick(&mut custody, &mut store, ms(0));
    assert!(ended(&out).is_empty(), "within its window");
    assert_eq!(custody.scan().waiting(), 1);
    assert_eq!(custody.poll_timeout(), Some(ms(1_000)), "the scan interval");
    let out = tick(&mut custody, &mut store, ms(29_999));
    assert!(ended(&out).is_empty());
    // The next scan comes at least MIN_SCAN_PAUSE later.
    let out = tick(&mut custody, &mut store, ms(30_049));
    assert_eq!(ended(&out), vec![("r1", "edge_restart")]);
    assert_eq!(status(&store, "r1"), RecordStatus::Incomplete);
    assert_eq!(
        store.records["r1"].0.epoch, 2,
        "raised before the terminal (R-JRN-3)"
    );
    tick(&mut custody, &mut store, ms(30_099));
    assert_eq!(
        custody.poll_timeout(),
        None,
        "a sole store with no orphan left"
    );
}

#[test]
fn r_take_1_a_record_run_here_is_never_taken() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["Hel"]);
    store.live.insert("r1".into());
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let out = tick(&mut custody, &mut store, ms(60_000));
    assert!(ended(&out).is_empty());
    assert_eq!(status(&store, "r1"), RecordStatus::InProgress);
    assert_eq!(store.records["r1"].0.epoch, 1);
}

#[test]
fn r_take_1_r_cont_1_an_orphan_whose_route_continues_is_continued_from_its_journal() {
    let mut store = Store {
        continuable: true,
        ..Store::default()
    };
    store.add(record("r1", ME), &["Hel", "lo"]);
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let out = tick(&mut custody, &mut store, ms(30_000));
    let continued: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Continue { meta, resumed } => Some((meta.clone(), resumed.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(continued.len(), 1, "{out:?}");
    let (meta, resumed) = &continued[0];
    assert_eq!(meta.epoch, 2, "the epoch is won before the run starts");
    assert_eq!(resumed.text, "Hello");
    assert_eq!(resumed.last_seq, 2);
    assert_eq!(resumed.provider_id, Some(ProviderId::from("p1")));
    assert!(ended(&out).is_empty());
    assert_eq!(
        status(&store, "r1"),
        RecordStatus::InProgress,
        "its run ends it"
    );
}

#[test]
fn r_cont_1_an_orphan_with_a_tool_call_or_no_text_ends_incomplete() {
    let mut store = Store {
        continuable: true,
        ..Store::default()
    };
    store.add(record("r1", ME), &[]);
    store.add(record("r2", ME), &["a"]);
    let (meta, events) = store.records.get_mut("r2").expect("r2");
    events.push(JournalEvent {
        seq: 2,
        payload: encode_entry(
            &Delivery::Event(RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: Some("c".into()),
                name: Some("f".into()),
                arguments_delta: "{".into(),
            })),
            None,
        ),
    });
    meta.last_seq = 2;
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let out = tick(&mut custody, &mut store, ms(30_000));
    let mut why: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Event(CustodyEvent::Ended {
                id, not_continued, ..
            }) => Some((id.clone(), *not_continued)),
            _ => None,
        })
        .collect();
    why.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        why,
        vec![
            ("r1".into(), Some(NotContinuable::NoText)),
            ("r2".into(), Some(NotContinuable::ToolCall)),
        ]
    );
    assert!(
        !out.iter()
            .any(|o| matches!(o, CustodyOutput::Continue { .. }))
    );
}

#[test]
fn r_multi_1_a_renewing_edges_record_is_kept_and_an_expired_ones_taken_over() {
    let mut store = Store::default();
    store.add(record("r1", PEER), &["x"]);
    store.lease(PEER, 1);
    let mut custody = Custody::new(ms(0), config(false));
    tick(&mut custody, &mut store, ms(0));
    // The peer renews: its lease revision moves while observed.
    for t in 1..40u64 {
        store.lease(PEER, 1 + t);
        let out = tick(&mut custody, &mut store, ms(t * 1_000));
        assert!(ended(&out).is_empty(), "alive at {t} s");
    }
    // It stops renewing: expired after its TTL, then the park window.
    let mut all = Vec::new();
    for t in 40..100u64 {
        all.extend(tick(&mut custody, &mut store, ms(t * 1_000)));
    }
    assert_eq!(ended(&all), vec![("r1", "edge_lost")]);
    assert_eq!(store.records["r1"].0.owner, ME);
}

#[test]
fn r_jrn_3_a_raise_beaten_by_a_live_edge_is_given_up_and_one_beaten_by_a_zombie_is_retried() {
    // Beaten by a live Edge: that one owns the record now.
    let mut store = Store::default();
    store.add(record("r1", ME), &["x"]);
    store.lease(PEER, 1);
    store.beaten_by = Some(PEER.into());
    let mut custody = Custody::new(ms(0), config(false));
    let mut out = Vec::new();
    for t in 0..=40u64 {
        // The peer renews throughout.
        store.lease(PEER, 1 + t);
        out.extend(tick(&mut custody, &mut store, ms(t * 1_000)));
    }
    assert!(ended(&out).is_empty(), "{out:?}");
    assert_eq!(
        store
            .ops
            .iter()
            .filter(|o| matches!(o, StoreOp::RaiseEpoch { .. }))
            .count(),
        1,
        "not raised again once a live Edge owns it"
    );
    assert_eq!(store.records["r1"].0.owner, PEER);
    assert_eq!(status(&store, "r1"), RecordStatus::InProgress);
    assert_eq!(custody.tasks(), 0);

    // Beaten by a late raise of this Edge's own former run: still an
    // orphan, raised again at once from the epoch the record has now.
    let mut store = Store::default();
    store.add(record("r1", ME), &["x"]);
    store.beaten_by = Some(ME.into());
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let out = tick(&mut custody, &mut store, ms(30_000));
    assert_eq!(ended(&out), vec![("r1", "edge_restart")]);
    assert_eq!(store.records["r1"].0.epoch, 3);
    assert!(out.iter().any(|o| matches!(
        o,
        CustodyOutput::Event(CustodyEvent::Retried {
            error: JournalError::Fenced { .. },
            ..
        })
    )));
}

#[test]
fn a_store_failure_is_read_again_after_a_pause_and_writes_are_bounded() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["x"]);
    store.fail_next = vec!["raise", "finish"];
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let out = tick(&mut custody, &mut store, ms(30_000));
    assert!(ended(&out).is_empty());
    assert!(custody.poll_timeout() <= Some(ms(30_000) + STORE_RETRY));
    let out = tick(&mut custody, &mut store, ms(30_000) + STORE_RETRY);
    assert!(ended(&out).is_empty(), "the terminal failed once");
    let at = ms(30_000) + STORE_RETRY + STORE_RETRY;
    let out = tick(&mut custody, &mut store, at);
    assert_eq!(ended(&out), vec![("r1", "edge_restart")]);

    // A store that always fails: the takeover gives up after its writes.
    let mut store = Store::default();
    store.add(record("r1", ME), &["x"]);
    store.fail_next = vec!["raise"; 100];
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let mut now = ms(30_000);
    let mut gave_up = false;
    for _ in 0..100 {
        let out = tick(&mut custody, &mut store, now);
        gave_up |= out
            .iter()
            .any(|o| matches!(o, CustodyOutput::Event(CustodyEvent::GaveUp { .. })));
        now += STORE_RETRY;
    }
    assert!(gave_up);
    let raises = store
        .ops
        .iter()
        .filter(|o| matches!(o, StoreOp::RaiseEpoch { .. }))
        .count();
    assert_eq!(raises, MAX_TAKEOVER_WRITES as usize);
    // The store recovers: a later scan finds the record again (a sole
    // store is read whole again), and after a new window it is ended.
    store.fail_next.clear();
    let mut ended_at = None;
    for _ in 0..1_000 {
        let out = tick(&mut custody, &mut store, now);
        if !ended(&out).is_empty() {
            ended_at = Some(now);
            break;
        }
        now += Duration::from_millis(100);
    }
    assert!(ended_at.is_some(), "never taken over again");
    assert_eq!(status(&store, "r1"), RecordStatus::Incomplete);
}

#[test]
fn r_park_2_a_reported_run_is_adopted_after_the_raise_from_a_fresh_read() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["a", "b"]);
    let mut custody = Custody::new(ms(0), config(false));
    custody.handle_input(ms(5), CustodyInput::Offer(offer("r1")));
    let out = drive(&mut custody, &mut store, ms(5));
    assert_eq!(adopted(&out), vec![(2, 2, true)]);
    // The event was read before and after the raise.
    let reads = store
        .ops
        .iter()
        .filter(|o| matches!(o, StoreOp::Event { .. }))
        .count();
    assert_eq!(reads, 2);
}

#[test]
fn r_park_2_a_report_that_is_not_the_records_run_is_let_go_without_a_raise() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["a"]);
    let mut ended = record("r2", ME);
    ended.terminal = Some(crate::journal::Terminal {
        status: RecordStatus::Failed,
        reason: None,
        message: None,
        at_unix_ms: 1,
    });
    store.add(ended, &[]);
    store.add(record("r3", ME), &["a"]);
    store.live.insert("r3".into());
    let mut custody = Custody::new(ms(0), config(false));
    let mut other = offer("r1");
    other.provider_id = ProviderId::from("p2");
    let mut reasons = Vec::new();
    for o in [other, offer("r2"), offer("r3"), offer("nope")] {
        custody.handle_input(ms(5), CustodyInput::Offer(o));
        for out in drive(&mut custody, &mut store, ms(5)) {
            if let CustodyOutput::Release { reason, .. } = out {
                reasons.push(reason.as_str());
            }
        }
    }
    assert_eq!(
        reasons,
        vec![
            "another_run",
            "response_ended",
            "live_here",
            "unknown_response"
        ]
    );
    assert!(
        !store
            .ops
            .iter()
            .any(|o| matches!(o, StoreOp::RaiseEpoch { .. }))
    );
}

/// R-PARK-2, R-TAKE-1, R-IDEM-1: an Edge that died after starting a run
/// and before journaling any of it left a record with no event; the run
/// its node reports is adopted from its first frame, not let go (which
/// would end the record with nothing and let a retry call a provider
/// again).
#[test]
fn r_park_2_a_run_whose_record_holds_nothing_yet_is_adopted_from_its_first_frame() {
    let mut store = Store::default();
    store.add(record("r1", ME), &[]);
    let mut custody = Custody::new(ms(0), config(false));
    custody.handle_input(ms(5), CustodyInput::Offer(offer("r1")));
    let out = drive(&mut custody, &mut store, ms(5));
    assert_eq!(adopted(&out), vec![(2, 0, false)], "{out:?}");
    assert!(
        !store
            .ops
            .iter()
            .any(|o| matches!(o, StoreOp::Event { .. } | StoreOp::Events { .. })),
        "no event to read: {:?}",
        store.ops
    );
}

/// R-PARK-2, R-JRN-3: a record empty when first read may hold events by
/// the time the raise wins (its former writer appended in between); the
/// report is then decided on those events like any other: another run's
/// frames let the report go.
#[test]
fn r_park_2_a_record_that_got_events_before_the_raise_is_decided_on_them() {
    let mut store = Store::default();
    store.add(record("r1", ME), &[]);
    let mut custody = Custody::new(ms(0), config(false));
    custody.handle_input(ms(5), CustodyInput::Offer(offer("r1")));
    let mut released = Vec::new();
    let mut adopted = 0;
    for _ in 0..100 {
        let Some(out) = custody.poll_output() else {
            break;
        };
        match out {
            CustodyOutput::Store(op) => {
                if matches!(op, StoreOp::RaiseEpoch { .. }) {
                    // The former writer's append, from another run.
                    let (meta, events) = store.records.get_mut("r1").unwrap();
                    let mut other = offer("r1");
                    other.run.key.run_id += 1;
                    events.push(JournalEvent {
                        seq: 1,
                        payload: encode_entry(
                            &Delivery::Event(RunEventKind::TextDelta("x".into())),
                            Some(FrameSource {
                                key: other.run.key,
                                frame: 1,
                                provider_id: ProviderId::from("p1"),
                            }),
                        ),
                    });
                    meta.last_seq = 1;
                }
                let answer = store.answer(op);
                custody.handle_input(ms(5), CustodyInput::Store(answer));
            }
            CustodyOutput::Release { reason, .. } => released.push(reason.as_str()),
            CustodyOutput::Adopt { .. } => adopted += 1,
            _ => {}
        }
    }
    assert_eq!((adopted, released), (0, vec!["another_run"]));
}

#[test]
fn an_offer_for_a_record_being_taken_over_is_let_go() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["a"]);
    let mut custody = Custody::new(ms(0), config(true));
    custody.handle_input(ms(0), CustodyInput::Offer(offer("r1")));
    // Its record read is still out: a second offer finds the task.
    custody.handle_input(ms(0), CustodyInput::Offer(offer("r1")));
    let out = drive(&mut custody, &mut store, ms(0));
    assert!(out.iter().any(|o| matches!(
        o,
        CustodyOutput::Release {
            reason: ReleaseReason::Busy,
            ..
        }
    )));
    assert_eq!(
        out.iter()
            .filter(|o| matches!(o, CustodyOutput::Adopt { .. }))
            .count(),
        1
    );
}

/// R-TEN-2, R-JRN-6: the answer so far is what a lost adoption is charged
/// by; a store that failed its read is read again after a pause, and the
/// run is adopted with it, not without.
#[test]
fn r_ten_2_an_adoptions_answer_so_far_is_read_again_when_the_store_failed() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["a", "b"]);
    store.fail_next = vec!["events"];
    let mut custody = Custody::new(ms(0), config(true));
    custody.handle_input(ms(5), CustodyInput::Offer(offer("r1")));
    let out = drive(&mut custody, &mut store, ms(5));
    assert!(adopted(&out).is_empty(), "not adopted yet: {out:?}");
    assert!(
        out.iter()
            .any(|o| matches!(o, CustodyOutput::Event(CustodyEvent::Retried { .. })))
    );
    assert!(
        custody
            .poll_timeout()
            .is_some_and(|at| at <= ms(5) + STORE_RETRY)
    );
    let out = tick(&mut custody, &mut store, ms(5) + STORE_RETRY);
    let resumed: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Adopt { resumed, meta, .. } => Some((meta.epoch, resumed.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(resumed.len(), 1, "{out:?}");
    assert_eq!(
        resumed[0].1.as_ref().map(|r| r.text.as_str()),
        Some("ab"),
        "adopted with the answer so far"
    );
}

#[test]
fn r_cont_1_an_adoption_on_a_continuing_route_carries_the_answer_so_far() {
    let mut store = Store {
        continuable: true,
        ..Store::default()
    };
    store.add(record("r1", ME), &["a", "b"]);
    let mut custody = Custody::new(ms(0), config(false));
    custody.handle_input(ms(5), CustodyInput::Offer(offer("r1")));
    let out = drive(&mut custody, &mut store, ms(5));
    let resumed: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Adopt { resumed, .. } => Some(resumed.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0].as_ref().map(|r| r.text.as_str()), Some("ab"));
}

#[test]
fn r_multi_1_a_live_edges_parked_run_is_not_adopted_and_a_dead_ones_is_once_its_lease_expired() {
    // The owner renews throughout: its own request takes the run; this
    // Edge waits the owner's TTL and lets the report go, raising nothing.
    let mut store = Store::default();
    store.add(record("r1", PEER), &["a", "b"]);
    store.lease(PEER, 1);
    let mut custody = Custody::new(ms(0), config(false));
    tick(&mut custody, &mut store, ms(0));
    custody.handle_input(ms(10), CustodyInput::Offer(offer("r1")));
    let mut out = drive(&mut custody, &mut store, ms(10));
    for t in 1..=10u64 {
        store.lease(PEER, 1 + t);
        out.extend(tick(&mut custody, &mut store, ms(t * 1_000)));
    }
    assert!(
        out.iter().any(|o| matches!(
            o,
            CustodyOutput::Release {
                reason: ReleaseReason::OwnerAlive,
                ..
            }
        )),
        "{out:?}"
    );
    assert!(!out.iter().any(|o| matches!(o, CustodyOutput::Adopt { .. })));
    assert!(
        !store
            .ops
            .iter()
            .any(|o| matches!(o, StoreOp::RaiseEpoch { .. }))
    );
    assert_eq!(store.records["r1"].0.owner, PEER);

    // The owner stopped renewing: adopted once its lease expired.
    let mut store = Store::default();
    store.add(record("r1", PEER), &["a", "b"]);
    store.lease(PEER, 1);
    let mut custody = Custody::new(ms(0), config(false));
    tick(&mut custody, &mut store, ms(0));
    custody.handle_input(ms(10), CustodyInput::Offer(offer("r1")));
    let mut out = drive(&mut custody, &mut store, ms(10));
    assert!(
        !out.iter().any(|o| matches!(o, CustodyOutput::Adopt { .. })),
        "waits"
    );
    for t in 1..=10u64 {
        out.extend(tick(&mut custody, &mut store, ms(t * 500)));
    }
    let adopted = out
        .iter()
        .filter(|o| matches!(o, CustodyOutput::Adopt { .. }))
        .count();
    assert_eq!(adopted, 1, "{out:?}");
    assert_eq!(store.records["r1"].0.owner, ME);
}

/// R-LIM-6: every store operation of a takeover that reads (the scan, the
/// record, its events) takes a place of the takeovers' share of store
/// reads; its writes (raising the epoch, the terminal) do not.
#[test]
fn r_lim_6_a_takeovers_reads_take_places_and_its_writes_do_not() {
    let id = || "resp_0123456789abcdef".to_owned();
    for op in [
        StoreOp::Unfinished { hint: true },
        StoreOp::Leases,
        StoreOp::Lease {
            edge_id: "e1".into(),
        },
        StoreOp::Record { id: id() },
        StoreOp::Event { id: id(), seq: 1 },
        StoreOp::Events { id: id() },
    ] {
        assert!(op.reads(), "{op:?}");
    }
    for op in [
        StoreOp::RaiseEpoch {
            id: id(),
            expected: 1,
        },
        StoreOp::Finish {
            id: id(),
            epoch: 2,
            terminal: Terminal {
                status: RecordStatus::Incomplete,
                reason: None,
                message: None,
                at_unix_ms: 0,
            },
        },
    ] {
        assert!(!op.reads(), "{op:?}");
    }
}

fn charges(outputs: &[CustodyOutput]) -> Vec<(String, JournaledUse)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Charge { meta, used } => Some((meta.id.clone(), *used)),
            _ => None,
        })
        .collect()
}

/// R-TEN-2: an orphan a takeover ends `incomplete` without running it (a
/// route that does not continue answers) is charged what its journal
/// holds, read after the raise and before the terminal, once its terminal
/// is durable at the epoch this Edge won: the text's estimate, and the
/// prompt as its reservation estimated it (no usage was journaled).
#[test]
fn r_ten_2_an_orphan_ended_incomplete_is_charged_its_journal_text_once() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["Hello, wo", "rld"]);
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let out = tick(&mut custody, &mut store, ms(30_000));
    assert_eq!(ended(&out), vec![("r1", "edge_restart")]);
    let charged = charges(&out);
    assert_eq!(
        charged,
        vec![(
            "r1".to_owned(),
            JournaledUse {
                usage: None,
                // "Hello, world": 12 characters.
                text_tokens: 3,
            }
        )]
    );
    // Its key and principal are the record's; the prompt is the driver's
    // estimate of the stored request.
    let meta = out
        .iter()
        .find_map(|o| match o {
            CustodyOutput::Charge { meta, .. } => Some(meta.clone()),
            _ => None,
        })
        .expect("charged");
    assert_eq!((meta.key_id.as_str(), meta.epoch), ("k", 2));
    assert_eq!(
        charged[0].1.charged(40),
        Some(crate::tenant::TokenUse {
            input: 40,
            output: 3,
            ..Default::default()
        })
    );
    // The events were read after the raise (a read of the takeovers'
    // share, R-LIM-6), the terminal written after them.
    let order: Vec<&str> = store
        .ops
        .iter()
        .filter_map(|o| match o {
            StoreOp::RaiseEpoch { .. } => Some("raise"),
            StoreOp::Events { .. } => Some("events"),
            StoreOp::Finish { .. } => Some("finish"),
            _ => None,
        })
        .collect();
    assert_eq!(order, vec!["raise", "events", "finish"]);
    assert!(StoreOp::Events { id: "r1".into() }.reads());
    // Never again.
    let mut later = Vec::new();
    for t in 1..=5u64 {
        later.extend(tick(&mut custody, &mut store, ms(30_000 + t * 1_000)));
    }
    assert!(charges(&later).is_empty(), "{later:?}");
}

/// R-TEN-2: only the writer whose terminal is durable charges: a raise
/// beaten by another writer, a terminal the store failed, charge nothing;
/// the takeover that ends the record charges once.
#[test]
fn r_ten_2_a_fenced_or_failed_takeover_charges_only_once_its_terminal_is_durable() {
    // Beaten by a live Edge: that one owns the record, nothing is charged
    // here.
    let mut store = Store::default();
    store.add(record("r1", ME), &["xyz"]);
    store.lease(PEER, 1);
    store.beaten_by = Some(PEER.into());
    let mut custody = Custody::new(ms(0), config(false));
    let mut out = Vec::new();
    for t in 0..=40u64 {
        store.lease(PEER, 1 + t);
        out.extend(tick(&mut custody, &mut store, ms(t * 1_000)));
    }
    assert!(charges(&out).is_empty(), "{out:?}");

    // Its raise fenced once, its terminal failed once: charged once, when
    // the terminal is durable.
    let mut store = Store::default();
    store.add(record("r1", ME), &["xyz"]);
    store.beaten_by = Some(ME.into());
    store.fail_next = vec!["finish"];
    let mut custody = Custody::new(ms(0), config(true));
    let mut out = Vec::new();
    let mut now = ms(0);
    for _ in 0..20 {
        out.extend(tick(&mut custody, &mut store, now));
        now += Duration::from_millis(30_000 / 10);
    }
    assert_eq!(ended(&out), vec![("r1", "edge_restart")]);
    assert_eq!(charges(&out).len(), 1, "{out:?}");
    assert_eq!(charges(&out)[0].1.text_tokens, 1);
}

/// R-TEN-2: the text after the last usage journaled is estimated; the
/// usage covers the prompt and the text before it. A tool call does not
/// stop the count (the answer ends either way); a journal with neither
/// text nor usage charges nothing.
#[test]
fn r_ten_2_an_ended_answers_charge_is_its_journaled_usage_and_the_text_after_it() {
    let mut store = Store {
        continuable: true,
        ..Store::default()
    };
    store.add(record("r1", ME), &["abcd", "efgh"]);
    store.add(record("r2", ME), &[]);
    let usage = iop_wire::Usage::tokens(7, 2);
    let (meta, events) = store.records.get_mut("r1").expect("r1");
    for (seq, delivery) in [
        (3, Delivery::Event(RunEventKind::Usage(usage))),
        (4, Delivery::Event(RunEventKind::TextDelta("ijklm".into()))),
        (
            5,
            Delivery::Event(RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: Some("c".into()),
                name: Some("f".into()),
                arguments_delta: "{".into(),
            })),
        ),
    ] {
        events.push(JournalEvent {
            seq,
            payload: encode_entry(&delivery, None),
        });
    }
    meta.last_seq = 5;
    let mut custody = Custody::new(ms(0), config(true));
    tick(&mut custody, &mut store, ms(0));
    let out = tick(&mut custody, &mut store, ms(30_000));
    assert_eq!(ended(&out).len(), 2, "not continued: a tool call, no text");
    let charged = charges(&out);
    assert_eq!(
        charged,
        vec![(
            "r1".to_owned(),
            JournaledUse {
                usage: Some(usage),
                text_tokens: 2,
            }
        )],
        "r2 journaled nothing"
    );
    assert_eq!(
        charged[0].1.charged(40),
        Some(crate::tenant::TokenUse {
            input: 7,
            output: 2 + 2,
            ..Default::default()
        }),
        "the usage covers the prompt"
    );
}

/// R-TEN-2: an adoption on a route that does not continue answers carries
/// the answer so far too: a lost adoption is charged the text before it
/// (it is never continued: its request's route says so).
#[test]
fn r_ten_2_an_adoption_on_a_route_that_does_not_continue_carries_the_answer_so_far() {
    let mut store = Store::default();
    store.add(record("r1", ME), &["a", "b"]);
    let mut custody = Custody::new(ms(0), config(false));
    custody.handle_input(ms(5), CustodyInput::Offer(offer("r1")));
    let out = drive(&mut custody, &mut store, ms(5));
    let resumed: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            CustodyOutput::Adopt { resumed, .. } => Some(resumed.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0].as_ref().map(|r| r.text.as_str()), Some("ab"));
    assert!(charges(&out).is_empty(), "its request charges it");
}

/// A store holding orphan `r1` of a route that continues answers or not,
/// whose writer journaled its answer (`a`, `b`) and its end, then died
/// before writing the record's terminal.
fn an_orphan_whose_end_is_journaled(continuable: bool) -> Store {
    let mut store = Store {
        continuable,
        ..Store::default()
    };
    store.add(record("r1", ME), &["a", "b"]);
    let (meta, events) = store.records.get_mut("r1").expect("r1");
    events.push(JournalEvent {
        seq: 3,
        payload: encode_entry(&Delivery::Finish, None),
    });
    meta.last_seq = 3;
    store
}

#[test]
fn r_take_1_an_orphan_whose_end_is_journaled_ends_as_the_journal_says_not_incomplete() {
    // Its writer journaled the answer's end and died before writing the
    // record's terminal: the answer is whole in the journal.
    for continuable in [true, false] {
        let mut store = an_orphan_whose_end_is_journaled(continuable);
        let mut custody = Custody::new(ms(0), config(continuable));
        tick(&mut custody, &mut store, ms(0));
        let out = tick(&mut custody, &mut store, ms(30_000));
        assert_eq!(
            status(&store, "r1"),
            RecordStatus::Completed,
            "continuable {continuable}: {out:?}"
        );
        assert!(
            !out.iter()
                .any(|o| matches!(o, CustodyOutput::Continue { .. })),
            "never run again"
        );
    }
}

#[cfg(feature = "planted-bugs")]
#[test]
fn ignore_journaled_end_ends_such_an_orphan_incomplete_as_before_the_fix() {
    // The planted bug the simulator's R-TAKE-1 check must catch.
    use crate::planted::{PlantedBug, clear_thread, plant_in_thread};
    let mut store = an_orphan_whose_end_is_journaled(false);
    let mut custody = Custody::new(ms(0), config(false));
    plant_in_thread(PlantedBug::IgnoreJournaledEnd);
    tick(&mut custody, &mut store, ms(0));
    tick(&mut custody, &mut store, ms(30_000));
    clear_thread();
    assert_eq!(status(&store, "r1"), RecordStatus::Incomplete);
}

/// A custody of a sole store whose first scan found nothing, and a record
/// `r1` of this Edge with `texts` its request wrote and then left open
/// (its terminal refused by the store too often): not live here any more.
fn left_open(texts: &[&str], continuable: bool) -> (Custody, Store) {
    left_open_in(texts, continuable, true)
}

/// [`left_open`] on a store of its own (`sole`) or shared with peers.
fn left_open_in(texts: &[&str], continuable: bool, sole: bool) -> (Custody, Store) {
    let mut store = Store {
        continuable,
        ..Store::default()
    };
    let mut custody = Custody::new(ms(0), config(sole));
    tick(&mut custody, &mut store, ms(0));
    if sole {
        assert_eq!(custody.poll_timeout(), None, "nothing to scan for");
    }
    store.add(record("r1", ME), texts);
    (custody, store)
}

/// R-JRN-4, R-JRN-6: a record a request of this Edge left without its
/// terminal (the store refused it too often) is ended by the Edge's
/// custody at once, not at the next restart's scan: raised (R-JRN-3),
/// ended `failed` as its request would have, never continued (even on a
/// continuing route), and charged nothing (its request settled it,
/// R-TEN-2).
#[test]
fn r_jrn_4_a_record_its_request_left_open_is_ended_by_the_custody_without_a_restart() {
    let (mut custody, mut store) = left_open(&["Hel", "lo"], true);
    custody.handle_input(ms(5_000), CustodyInput::RunLeftOpen("r1".into()));
    let out = drive(&mut custody, &mut store, ms(5_000));
    assert_eq!(ended(&out), vec![("r1", JOURNAL_UNAVAILABLE_REASON)]);
    let (meta, events) = &store.records["r1"];
    assert_eq!(meta.status(), RecordStatus::Failed);
    assert_eq!(meta.epoch, 2, "raised before the terminal (R-JRN-3)");
    assert_eq!(events.len(), 2, "its durable prefix kept");
    assert!(charges(&out).is_empty(), "its request settled it: {out:?}");
    assert!(
        !out.iter()
            .any(|o| matches!(o, CustodyOutput::Continue { .. })),
        "never continued"
    );
    assert_eq!(custody.poll_timeout(), None);
}

/// R-JRN-4, R-TAKE-1: a record left open whose journal holds its
/// answer's end (the request's last append was durable, its terminal
/// not) ends as its journal says.
#[test]
fn r_jrn_4_a_record_left_open_with_its_end_journaled_ends_as_the_journal_says() {
    let mut store = an_orphan_whose_end_is_journaled(false);
    let mut custody = Custody::new(ms(0), config(true));
    // Run here when the Edge started; its request then left it open.
    store.live.insert("r1".into());
    tick(&mut custody, &mut store, ms(0));
    store.live.clear();
    custody.handle_input(ms(1_000), CustodyInput::RunLeftOpen("r1".into()));
    drive(&mut custody, &mut store, ms(1_000));
    assert_eq!(status(&store, "r1"), RecordStatus::Completed);
}

/// R-JRN-6: while the store still fails, the custody reads the record
/// left open again after each pause, until it ends it; however long the
/// outage, it does not give the record up.
#[test]
fn r_jrn_6_a_record_left_open_is_tried_until_the_store_answers() {
    let (mut custody, mut store) = left_open(&["x"], false);
    store.fail_next = vec!["record"; 500];
    custody.handle_input(ms(1_000), CustodyInput::RunLeftOpen("r1".into()));
    let mut now = ms(1_000);
    drive(&mut custody, &mut store, now);
    for _ in 0..400 {
        now = custody.poll_timeout().expect("it reads again later");
        let out = tick(&mut custody, &mut store, now);
        assert!(ended(&out).is_empty());
    }
    store.fail_next.clear();
    now = custody.poll_timeout().expect("it reads again later");
    let out = tick(&mut custody, &mut store, now);
    assert_eq!(ended(&out), vec![("r1", JOURNAL_UNAVAILABLE_REASON)]);
    assert_eq!(status(&store, "r1"), RecordStatus::Failed);
}

/// R-JRN-3, R-MULTI-1: a record left open that another Edge took over
/// meanwhile (its raise came first) is left to that Edge.
#[test]
fn r_jrn_3_a_record_left_open_that_another_edge_raised_is_left_to_it() {
    let (mut custody, mut store) = left_open_in(&["x"], false, false);
    store.lease(PEER, 1);
    store.beaten_by = Some(PEER.into());
    custody.handle_input(ms(1_000), CustodyInput::RunLeftOpen("r1".into()));
    let mut out = drive(&mut custody, &mut store, ms(1_000));
    // Later scans leave it to its live owner too.
    for t in 1..=5u64 {
        store.lease(PEER, 1 + t);
        out.extend(tick(&mut custody, &mut store, ms(1_000 + t * 1_000)));
    }
    assert!(ended(&out).is_empty(), "{out:?}");
    assert_eq!(status(&store, "r1"), RecordStatus::InProgress);
    assert_eq!(store.records["r1"].0.owner, PEER);
}

/// R-JRN-4: on a store shared with peers, where the scans find the
/// Edge's own records whose run ended too, a record left open is still
/// ended as left open (at once, `failed`, charged nothing), and once.
#[test]
fn r_jrn_4_a_record_left_open_on_a_shared_store_is_ended_once_as_left_open() {
    let (mut custody, mut store) = left_open_in(&["x"], false, false);
    store.lease(ME, 1);
    custody.handle_input(ms(1_000), CustodyInput::RunLeftOpen("r1".into()));
    let mut out = drive(&mut custody, &mut store, ms(1_000));
    for t in 1..=40u64 {
        out.extend(tick(&mut custody, &mut store, ms(1_000 + t * 1_000)));
    }
    assert_eq!(ended(&out), vec![("r1", JOURNAL_UNAVAILABLE_REASON)]);
    assert!(charges(&out).is_empty(), "{out:?}");
}

/// R-JRN-4, R-TEN-2: a record left open whose raises the store keeps
/// failing past a takeover's writes is started again as left open, not
/// left to a scan (which would charge it again): once the store takes the
/// writes it ends `failed`, charged nothing.
#[test]
fn r_jrn_4_a_record_left_open_outlasting_a_takeovers_writes_is_still_ended_as_left_open() {
    let (mut custody, mut store) = left_open_in(&["x"], false, false);
    store.lease(ME, 1);
    let raises = MAX_TAKEOVER_WRITES as usize + 8;
    store.fail_next = vec!["raise"; raises];
    custody.handle_input(ms(1_000), CustodyInput::RunLeftOpen("r1".into()));
    let mut now = ms(1_000);
    let mut out = drive(&mut custody, &mut store, now);
    for _ in 0..2_000 {
        if !ended(&out).is_empty() {
            break;
        }
        now = custody.poll_timeout().expect("it goes on").max(now);
        out.extend(tick(&mut custody, &mut store, now));
    }
    assert_eq!(ended(&out), vec![("r1", JOURNAL_UNAVAILABLE_REASON)]);
    assert!(charges(&out).is_empty(), "{out:?}");
    assert!(
        out.iter()
            .any(|o| matches!(o, CustodyOutput::Event(CustodyEvent::GaveUp { .. }))),
        "its writes were used once"
    );
    assert_eq!(status(&store, "r1"), RecordStatus::Failed);
}

/// R-TEN-2, R-JRN-6: more records left open than the custody has tasks
/// (a store outage under many durable answers) all wait here, none left
/// to a scan that would take it for an orphan and charge it again; while
/// any waits, the Edge refuses new durable requests. Once the store
/// answers, each ends `failed` as left open, charged nothing, and durable
/// requests are admitted again.
#[test]
fn r_ten_2_records_left_open_past_the_tasks_wait_here_and_refuse_durable_requests_meanwhile() {
    let mut store = Store::default();
    let mut custody = Custody::new(ms(0), config(false));
    store.lease(ME, 1);
    tick(&mut custody, &mut store, ms(0));
    let n = MAX_TASKS + 10;
    for i in 0..n {
        store.add(record(&format!("r{i}"), ME), &["x"]);
    }
    store.records_fail = true;
    let mut now = ms(1_000);
    for i in 0..n {
        custody.handle_input(now, CustodyInput::RunLeftOpen(format!("r{i}")));
    }
    let mut out = drive(&mut custody, &mut store, now);
    assert_eq!(custody.tasks(), MAX_TASKS);
    assert_eq!(custody.left_open_waiting(), 10);
    assert!(custody.refuses_durable());
    // Scans list every record as unfinished meanwhile, past any park
    // window; none is taken for an orphan.
    for _ in 0..60 {
        now = now.saturating_add(Duration::from_secs(1));
        out.extend(tick(&mut custody, &mut store, now));
        assert!(custody.refuses_durable());
    }
    assert!(ended(&out).is_empty(), "{:?}", ended(&out));
    store.records_fail = false;
    for _ in 0..100 {
        if !custody.refuses_durable() && custody.tasks() == 0 {
            break;
        }
        now = now.saturating_add(Duration::from_secs(1));
        out.extend(tick(&mut custody, &mut store, now));
    }
    assert!(!custody.refuses_durable());
    let ends = ended(&out);
    assert_eq!(ends.len(), n);
    assert!(
        ends.iter()
            .all(|(_, why)| *why == JOURNAL_UNAVAILABLE_REASON)
    );
    assert!(charges(&out).is_empty(), "each request settled its answer");
    assert!(
        store
            .records
            .values()
            .all(|(m, _)| m.status() == RecordStatus::Failed)
    );
}

/// R-TAKE-1, R-JRN-6: an orphan whose takeover's first read the store
/// failed is still ended once the store answers, however many scans ran
/// while its takeover paused (a scan saw it taken over, not waiting, and
/// a sole store's scans forgot it: it stayed open until a restart).
#[test]
fn r_take_1_an_orphan_whose_first_read_failed_is_ended_after_the_scans_that_ran_meanwhile() {
    for sole in [true, false] {
        let mut store = Store::default();
        store.lease(ME, 1);
        store.add(record("r1", ME), &["Hel"]);
        let mut custody = Custody::new(ms(0), config(sole));
        tick(&mut custody, &mut store, ms(0));
        store.records_fail = true;
        let mut now = ms(0);
        let mut out = Vec::new();
        // Its window ends; its takeover's reads fail for 3 s while scans
        // run.
        while now < ms(33_000) {
            now = custody.poll_timeout().expect("a timer").max(now);
            out.extend(tick(&mut custody, &mut store, now));
        }
        assert!(ended(&out).is_empty());
        store.records_fail = false;
        while ended(&out).is_empty() && now < ms(200_000) {
            let Some(at) = custody.poll_timeout() else {
                break;
            };
            now = at.max(now);
            out.extend(tick(&mut custody, &mut store, now));
        }
        assert_eq!(ended(&out), vec![("r1", "edge_restart")], "sole: {sole}");
        assert_eq!(status(&store, "r1"), RecordStatus::Incomplete);
        assert!(now < ms(34_000), "without a second window: {now:?}");
    }
}
