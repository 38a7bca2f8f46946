//! What the tenant test modules share: the tests' wall clock, a model of
//! the shared store, a request, and a world of Edges sharing that store,
//! driven by generated steps (the properties of `tests.rs` and
//! `model_tests.rs`).

use std::collections::{BTreeMap, VecDeque};

use proptest::prelude::*;

use super::*;

/// A minute's start: the tests' wall clock.
pub(super) const T0: u64 = 1_800_000_000_000 - 1_800_000_000_000 % MINUTE_MS;

pub(super) fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

/// The shared store: claimed per counter, every claim decided by
/// `check_claim`.
#[derive(Default)]
pub(super) struct Store {
    pub(super) claimed: BTreeMap<CounterKey, u64>,
    pub(super) down: bool,
    /// Concurrency gauges, and the store's wall clock for their leases.
    pub(super) slots: BTreeMap<CounterKey, slots::SlotBook>,
    pub(super) unix_ms: u64,
    /// Per counter, the holders whose give-back was applied.
    pub(super) gave_back: BTreeMap<CounterKey, std::collections::BTreeSet<String>>,
    /// Give-backs applied, and their answers lost (the Edge hears a
    /// failure): the next this many.
    pub(super) lose_give_back_answers: u32,
}

impl Store {
    /// Answer `out` of the Edge `holder` (its id in concurrency gauges).
    pub(super) fn answer_as(&mut self, holder: &str, out: TenantsOutput) -> TenantsInput {
        let (counter, amount, limit) = match out {
            TenantsOutput::Claim {
                counter,
                amount,
                limit,
            } => (counter, amount, limit),
            TenantsOutput::GiveBack { counter, amount } => {
                if self.down {
                    return TenantsInput::GaveBack {
                        counter,
                        outcome: None,
                    };
                }
                let stored = ClaimedCounter {
                    claimed: self.claimed.get(&counter).copied().unwrap_or(0),
                    gave_back: self.gave_back.get(&counter).cloned().unwrap_or_default(),
                };
                let (written, outcome) =
                    check_give_back(&stored, &counter, holder, amount, self.unix_ms);
                if let Some(written) = written {
                    self.claimed.insert(counter.clone(), written.claimed);
                    self.gave_back.insert(counter.clone(), written.gave_back);
                }
                if self.lose_give_back_answers > 0 {
                    self.lose_give_back_answers -= 1;
                    return TenantsInput::GaveBack {
                        counter,
                        outcome: None,
                    };
                }
                return TenantsInput::GaveBack {
                    counter,
                    outcome: Some(outcome),
                };
            }
            TenantsOutput::HoldSlots {
                counter,
                want,
                limit,
                lease_ms,
            } => {
                if self.down {
                    return TenantsInput::SlotsHeld {
                        counter,
                        held: None,
                    };
                }
                let book = self.slots.entry(counter.clone()).or_default();
                let held = book.hold(holder, want, limit, self.unix_ms, lease_ms);
                return TenantsInput::SlotsHeld {
                    counter,
                    held: Some(held),
                };
            }
        };
        if self.down {
            return TenantsInput::Claimed {
                counter,
                granted: None,
            };
        }
        let claimed = self.claimed.entry(counter.clone()).or_default();
        let (total, granted) = check_claim(*claimed, amount, limit);
        *claimed = total;
        TenantsInput::Claimed {
            counter,
            granted: Some(granted),
        }
    }

    /// Answer every claim of `edge` at once.
    pub(super) fn serve(&mut self, edge: &mut Tenants, now: Instant) {
        let holder = format!("edge-{:p}", edge as *const Tenants);
        while let Some(out) = edge.poll_output() {
            let input = self.answer_as(&holder, out);
            edge.handle_input(now, input);
        }
    }

    /// Answer every output of `edge`, the Edge `holder`, at `now` (ms on
    /// the manual clock): how many there were.
    pub(super) fn serve_as(&mut self, holder: &str, edge: &mut Tenants, now: u64) -> usize {
        let mut answered = 0;
        while let Some(out) = edge.poll_output() {
            answered += 1;
            let input = self.answer_as(holder, out);
            edge.handle_input(at(now), input);
        }
        answered
    }
}

/// A request of `key` (of `principal`) for `model` at `unix_ms`, with no
/// limits, 10 prompt tokens at most and 20 output tokens at most.
pub(super) fn request(
    ticket: u64,
    key: &str,
    principal: &str,
    model: &str,
    unix_ms: u64,
) -> AdmitRequest {
    AdmitRequest {
        ticket,
        key: key.into(),
        principal: principal.into(),
        key_limits: Limits::default(),
        principal_limits: Limits::default(),
        price: None,
        prompt_tokens_max: 10,
        output_tokens_max: 20,
        unix_ms,
        model: model.into(),
        durable: false,
        background: false,
        key_held: Held::default(),
        principal_held: Held::default(),
    }
}

/// One step of a world of Edges sharing a store; `who` (0 or 1) names
/// whose traffic it is (a principal, a model: the property's choice).
#[derive(Debug, Clone)]
pub(super) enum Step {
    /// A request of `who` at Edge `edge`.
    Admit { edge: usize, who: usize },
    /// The store answers Edge `edge`'s claims (or fails them).
    Serve { edge: usize, fail: bool },
    /// The oldest request of `who` at Edge `edge` ends, using `frac`/8 of
    /// its output reservation.
    Settle { edge: usize, who: usize, frac: u64 },
    /// Time passes.
    Tick { ms: u64 },
}

pub(super) fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..4usize, 0..2usize).prop_map(|(edge, who)| Step::Admit { edge, who }),
        3 => (0..4usize, prop::bool::weighted(0.05)).prop_map(|(edge, fail)| Step::Serve { edge, fail }),
        2 => (0..4usize, 0..2usize, 0..=8u64).prop_map(|(edge, who, frac)| Step::Settle { edge, who, frac }),
        1 => (0..20_000u64).prop_map(|ms| Step::Tick { ms }),
    ]
}

/// Edges sharing one store, each with what it asked the store and not yet
/// had answered, and the requests it admitted that have not ended.
pub(super) struct World {
    machines: Vec<Tenants>,
    pending: Vec<Vec<TenantsOutput>>,
    store: Store,
    /// Per Edge: (ticket, whose) of each open request, oldest first.
    open: Vec<VecDeque<(u64, usize)>>,
    /// The manual clock, ms.
    pub(super) ms: u64,
    ticket: u64,
}

impl World {
    /// `edges` Edges claiming a tenth of a limit at a time, with half a
    /// rate each while the store is down.
    pub(super) fn new(edges: usize) -> Self {
        let cfg = TenantsConfig {
            chunk_fraction: 0.1,
            local_share: 0.5,
            ..TenantsConfig::default()
        };
        World {
            machines: (0..edges).map(|_| Tenants::new(cfg)).collect(),
            pending: vec![Vec::new(); edges],
            store: Store::default(),
            open: vec![VecDeque::new(); edges],
            ms: 0,
            ticket: 0,
        }
    }

    fn edge(&self, edge: usize) -> usize {
        edge % self.machines.len()
    }

    /// Admit at Edge `edge` the request `make` builds of `who`, from a new
    /// ticket and the wall clock now: the machine's answer.
    pub(super) fn admit(
        &mut self,
        edge: usize,
        who: usize,
        make: impl FnOnce(u64, u64) -> AdmitRequest,
    ) -> Result<(), Refusal> {
        let e = self.edge(edge);
        self.ticket += 1;
        let r = make(self.ticket, T0 + self.ms);
        let answer = self.machines[e].admit(at(self.ms), &r);
        if answer.is_ok() {
            self.open[e].push_back((self.ticket, who));
        }
        self.collect(e);
        answer
    }

    /// The store answers (or, `fail`, fails) what Edge `edge` asked.
    pub(super) fn serve(&mut self, edge: usize, fail: bool) {
        let e = self.edge(edge);
        self.store.down = fail;
        for out in std::mem::take(&mut self.pending[e]) {
            let input = self.store.answer_as(&format!("edge-{e}"), out);
            self.machines[e].handle_input(at(self.ms), input);
        }
        self.collect(e);
    }

    /// The oldest open request of `who` at Edge `edge` ends, having used
    /// `used`: whether there was one.
    pub(super) fn settle(&mut self, edge: usize, who: usize, used: TokenUse) -> bool {
        let e = self.edge(edge);
        let oldest = self.open[e].iter().position(|(_, w)| *w == who);
        let Some((ticket, _)) = oldest.and_then(|i| self.open[e].remove(i)) else {
            return false;
        };
        self.machines[e].settle(at(self.ms), ticket, used);
        self.collect(e);
        true
    }

    /// `ms` pass: every Edge's timers fire.
    pub(super) fn tick(&mut self, ms: u64) {
        self.ms += ms;
        for e in 0..self.machines.len() {
            self.machines[e].handle_timeout(at(self.ms));
            self.collect(e);
        }
    }

    /// Every request still open ends having used `used`: whose each was.
    pub(super) fn settle_all(&mut self, used: TokenUse) -> Vec<usize> {
        let mut whose = Vec::new();
        for e in 0..self.machines.len() {
            while let Some((ticket, who)) = self.open[e].pop_front() {
                self.machines[e].settle(at(self.ms), ticket, used);
                whose.push(who);
            }
        }
        whose
    }

    fn collect(&mut self, e: usize) {
        let machine = &mut self.machines[e];
        self.pending[e].extend(std::iter::from_fn(|| machine.poll_output()));
    }
}
