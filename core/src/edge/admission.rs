//! Admission: per-provider capacity, a bounded FIFO queue with a timeout,
//! provider selection (R-SEL-1, R-SEL-2) and immutable leases released
//! exactly once (R-LEASE-1, R-LEASE-2).
//!
//! Admission does not know about connections: the dispatcher tells it which
//! generation of a provider's node is dispatchable ([`Admission::set_online`])
//! and whether the runtime overlay and health tracker allow the provider
//! ([`Admission::set_runtime_eligible`]). Every lease records the generation
//! it was granted on; the pre-send fence ([`Admission::pre_send`], R-GEN-4)
//! refuses a lease whose generation is no longer the online one.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, DefaultHasher};
use std::ops::Bound;
use std::time::Duration;

use iop_wire::{AdapterKind, RunKey};

use crate::ids::{Generation, NodeId, ProviderId, RunId};
#[cfg(feature = "planted-bugs")]
use crate::planted::{Planted, PlantedBug};
use crate::time::Instant;

/// How many leases released by a fence the planted `SkipPreSendFence` bug
/// keeps answering `Send` for.
#[cfg(feature = "planted-bugs")]
const PLANTED_FENCED_REMEMBERED: usize = 1024;

/// A client request's id, unique per Edge process.
pub type RequestId = u64;

/// A lease's id, unique per Edge process.
pub type LeaseId = u64;

/// A provider as configured on the Edge.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProviderSpec {
    /// Stable id.
    pub id: ProviderId,
    /// Node that runs it.
    pub node: NodeId,
    /// Adapter kind.
    pub adapter: AdapterKind,
    /// Target on the node.
    pub target: String,
    /// Concurrent leases allowed.
    pub capacity: u32,
    /// Configured stall timeout (wire value; 0 = default).
    pub stall_timeout_ms: u64,
}

/// Queue bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdmissionConfig {
    /// Requests that may wait for capacity.
    pub queue_capacity: usize,
    /// How long one may wait.
    pub queue_timeout: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 256,
            queue_timeout: Duration::from_secs(30),
        }
    }
}

/// A request for a provider of a route's pool (R-SEL-1).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DispatchRequest {
    /// The client request.
    pub request_id: RequestId,
    /// Candidate providers, in preference order.
    pub pool: Vec<ProviderId>,
    /// A provider to avoid (the one that just stalled), if any.
    pub avoid_provider_id: Option<ProviderId>,
    /// Allow the avoided provider when no alternate exists.
    pub allow_avoided_fallback: bool,
    /// A stall timeout kept from an earlier winning candidate (R-SEL-2).
    pub stall_timeout_ms: Option<u64>,
}

impl DispatchRequest {
    /// A first-attempt request with zero hints (normal selection).
    pub fn new(request_id: RequestId, pool: Vec<ProviderId>) -> Self {
        Self {
            request_id,
            pool,
            avoid_provider_id: None,
            allow_avoided_fallback: false,
            stall_timeout_ms: None,
        }
    }
}

/// An immutable capacity lease (R-LEASE-1).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lease {
    /// Lease id.
    pub lease_id: LeaseId,
    /// The request it serves.
    pub request_id: RequestId,
    /// Provider.
    pub provider_id: ProviderId,
    /// Adapter.
    pub adapter: AdapterKind,
    /// Target.
    pub target: String,
    /// Node.
    pub node: NodeId,
    /// The node generation the lease is bound to.
    pub generation: Generation,
    /// The run id to send to the node.
    pub run_id: RunId,
    /// Effective stall timeout of the winning candidate (R-SEL-2).
    pub stall_timeout_ms: u64,
}

/// Why a request could not be admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmitRejection {
    /// The queue is full (HTTP 429).
    QueueFull,
    /// The pool names no configured provider.
    NoRoute,
    /// The request id is already admitted or queued.
    DuplicateRequest,
    /// A re-admission that may not go back to the provider it avoids,
    /// while every other provider of its pool is offline: it would wait
    /// its whole queue timeout for nothing (R-FAIL-1).
    NoAlternate,
}

/// The immediate answer to [`Admission::request`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Admit {
    /// Leased now.
    Leased(Lease),
    /// Waiting for capacity; an [`AdmissionEvent`] follows.
    Queued,
    /// Refused.
    Rejected(AdmitRejection),
}

/// Why a lease was released (R-LEASE-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// Its valid current terminal arrived.
    Terminal,
    /// Its generation was fenced.
    Fenced,
    /// The client canceled or disconnected.
    ClientCancel,
    /// The pre-send fence found its generation stale (R-GEN-4).
    PreSendFence,
    /// The request's deadline passed.
    Deadline,
}

impl ReleaseReason {
    /// Closed label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Terminal => "terminal",
            ReleaseReason::Fenced => "fenced",
            ReleaseReason::ClientCancel => "client_cancel",
            ReleaseReason::PreSendFence => "pre_send_fence",
            ReleaseReason::Deadline => "deadline",
        }
    }
}

/// Something admission decided on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdmissionEvent {
    /// A queued request got a lease.
    Leased(Lease),
    /// A queued request waited past the queue timeout (or its pool vanished).
    QueueExpired {
        /// The request.
        request_id: RequestId,
    },
    /// A lease was released because its generation was fenced: the request's
    /// run ends with a transport terminal (R-GEN-3).
    LeaseFenced(Lease),
}

/// The answer of the pre-send fence.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreSend {
    /// Send it: the lease's generation is the online one.
    Send(Lease),
    /// Stale: the lease was released and the request re-resolved; a new
    /// [`AdmissionEvent::Leased`] (or expiry) follows.
    Refenced,
    /// No such lease (already released).
    UnknownLease,
}

/// The lease was already released, or never existed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease {0} is not held")]
pub struct NotHeld(pub LeaseId);

#[derive(Debug)]
struct ProviderState {
    spec: ProviderSpec,
    in_use: u32,
    online: Option<Generation>,
    runtime_eligible: bool,
}

impl ProviderState {
    fn selectable(&self) -> bool {
        self.online.is_some() && self.runtime_eligible
    }
    fn has_room(&self) -> bool {
        self.in_use < self.spec.capacity
    }
}

/// Capacity held for one parked run.
#[derive(Debug, Clone)]
struct Hold {
    provider_id: ProviderId,
    node: NodeId,
    generation: Generation,
    expires_at: Instant,
}

/// Why a parked run's capacity could not be held or adopted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldRefusal {
    /// No configured provider is that node's adapter and target.
    UnknownProvider,
    /// The provider is at capacity already.
    NoRoom,
    /// No hold for that run (expired, fenced, adopted already).
    NoHold,
    /// The hold's generation is not the provider's online one.
    NotOnline,
    /// Another parked run with the same key holds another provider: two
    /// Edges that started in the same millisecond hand out the same
    /// generations (R-MULTI-1), so their runs on one node can share a key.
    /// The hold (and the lease an adoption turns it into) would name the
    /// wrong provider, so the second is not held.
    KeyInUse,
}

#[derive(Debug)]
struct Queued {
    request: DispatchRequest,
    expires_at: Instant,
}

#[derive(Debug)]
struct Held {
    lease: Lease,
    request: DispatchRequest,
    expires_at: Instant,
}

/// A queued request's place in the queue: entries are served in this
/// order. The back counts up from 0; a request put back at the head
/// ([`Admission::pre_send`]'s re-resolution) counts down from -1.
type QueueSeq = i64;

/// What runs out at a deadline: a queued request's wait, or a parked run's
/// hold. Kept in [`Admission`]'s `expiries` beside the queue and the holds,
/// so the next deadline and every passed one are found in `O(log n)`, not
/// by a scan (the dispatcher calls them on every input, under the Edge's
/// lock).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Expiry {
    Queued(QueueSeq),
    Hold(NodeId, RunKey),
}

/// Which end of the queue a request joins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueueEnd {
    /// Behind every waiting request (a new one).
    Back,
    /// Ahead of them (one re-resolved after its lease was fenced).
    Head,
}

/// Where an admitted request is: each one is in exactly one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestSlot {
    /// Waiting in the queue, at this place.
    Queued(QueueSeq),
    /// Holding this lease.
    Held(LeaseId),
}

/// Request id -> slot, so the duplicate check, cancel and
/// [`Admission::lease_of_request`] are `O(1)`, not a scan of every held
/// lease and queue entry. The hasher has fixed keys: std's `RandomState`
/// seeds itself from the OS RNG, which core never touches. Request ids are
/// the Edge's own counter, never chosen by a peer.
type RequestIndex = HashMap<RequestId, RequestSlot, BuildHasherDefault<DefaultHasher>>;

/// A provider's capacity view, for the status surface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderCapacityView {
    /// Provider.
    pub provider_id: ProviderId,
    /// Leases held.
    pub in_use: u32,
    /// Capacity.
    pub capacity: u32,
    /// Online generation.
    pub online: Option<Generation>,
    /// Whether overlay and health allow it.
    pub runtime_eligible: bool,
}

/// Capacity, queue, selection and leases.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    providers: BTreeMap<ProviderId, ProviderState>,
    held: BTreeMap<LeaseId, Held>,
    /// Waiting requests in the order they are served.
    queue: BTreeMap<QueueSeq, Queued>,
    /// The place the next request at the queue's back takes.
    queue_back: QueueSeq,
    /// The place the next request put back at its head takes.
    queue_front: QueueSeq,
    /// Every queued request's and hold's deadline, in sync with both.
    expiries: BTreeSet<(Instant, Expiry)>,
    /// Every request in `queue` or `held`, kept in sync with both.
    requests: RequestIndex,
    next_lease_id: LeaseId,
    next_run_id: RunId,
    events: VecDeque<AdmissionEvent>,
    /// Set by every change that may let a queued request be served
    /// (capacity freed, a provider online or eligible): the queue is served
    /// once, at the next [`Admission::poll_event`], after every change of
    /// the caller's input is applied (R-SEL-1).
    serve_queue_at: Option<Instant>,
    leases_granted: u64,
    leases_released: u64,
    /// Capacity held for parked durable runs (R-PARK-2): their provider call
    /// goes on while no lease names them, so they count in `in_use` until a
    /// request adopts them (the hold becomes its lease) or the hold ends.
    /// By the reporting node and the run: a node's report can neither take
    /// nor let go another node's hold (R-PARK-2).
    holds: BTreeMap<(NodeId, RunKey), Hold>,
    #[cfg(feature = "planted-bugs")]
    planted: Planted,
    /// Leases the fence released, kept only while `SkipPreSendFence` is
    /// planted.
    #[cfg(feature = "planted-bugs")]
    planted_fenced: BTreeMap<LeaseId, Lease>,
}

impl Admission {
    /// Admission over `providers`.
    pub fn new(config: AdmissionConfig, providers: impl IntoIterator<Item = ProviderSpec>) -> Self {
        let providers = providers
            .into_iter()
            .map(|spec| {
                (
                    spec.id.clone(),
                    ProviderState {
                        spec,
                        in_use: 0,
                        online: None,
                        runtime_eligible: true,
                    },
                )
            })
            .collect();
        Self {
            config,
            providers,
            held: BTreeMap::new(),
            queue: BTreeMap::new(),
            queue_back: 0,
            queue_front: -1,
            expiries: BTreeSet::new(),
            requests: RequestIndex::default(),
            next_lease_id: 1,
            next_run_id: 1,
            events: VecDeque::new(),
            serve_queue_at: None,
            leases_granted: 0,
            leases_released: 0,
            holds: BTreeMap::new(),
            #[cfg(feature = "planted-bugs")]
            planted: Planted::default(),
            #[cfg(feature = "planted-bugs")]
            planted_fenced: BTreeMap::new(),
        }
    }

    /// Switch a planted bug on (test-only; see [`crate::planted`]).
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&self, bug: PlantedBug) {
        self.planted.plant(bug);
    }

    #[cfg(feature = "planted-bugs")]
    fn planted_any(&self) -> bool {
        self.planted.any()
    }

    #[cfg(not(feature = "planted-bugs"))]
    fn planted_any(&self) -> bool {
        false
    }

    /// The configuration.
    pub fn config(&self) -> AdmissionConfig {
        self.config
    }

    /// A configured provider.
    pub fn provider(&self, id: &ProviderId) -> Option<&ProviderSpec> {
        self.providers.get(id).map(|p| &p.spec)
    }

    /// Every configured provider.
    pub fn providers(&self) -> impl Iterator<Item = &ProviderSpec> {
        self.providers.values().map(|p| &p.spec)
    }

    /// Ask for a lease. Leased now, queued (an event follows), or refused.
    pub fn request(&mut self, now: Instant, request: DispatchRequest) -> Admit {
        if self.requests.contains_key(&request.request_id) {
            return Admit::Rejected(AdmitRejection::DuplicateRequest);
        }
        if !request.pool.iter().any(|p| self.providers.contains_key(p)) {
            return Admit::Rejected(AdmitRejection::NoRoute);
        }
        if let Some(lease) = self.try_lease(now, &request) {
            return Admit::Leased(lease);
        }
        if self.has_nowhere_to_go(&request) {
            return Admit::Rejected(AdmitRejection::NoAlternate);
        }
        if self.queue.len() >= self.config.queue_capacity {
            return Admit::Rejected(AdmitRejection::QueueFull);
        }
        let expires_at = now + self.config.queue_timeout;
        self.enqueue(request, expires_at, QueueEnd::Back);
        Admit::Queued
    }

    /// Put `request` in the queue at `end`, waiting until `expires_at`.
    fn enqueue(&mut self, request: DispatchRequest, expires_at: Instant, end: QueueEnd) {
        let seq = match end {
            QueueEnd::Back => {
                self.queue_back += 1;
                self.queue_back - 1
            }
            QueueEnd::Head => {
                self.queue_front -= 1;
                self.queue_front + 1
            }
        };
        self.requests
            .insert(request.request_id, RequestSlot::Queued(seq));
        self.expiries.insert((expires_at, Expiry::Queued(seq)));
        self.queue.insert(
            seq,
            Queued {
                request,
                expires_at,
            },
        );
    }

    /// Take the request at `seq` out of the queue (its index entry is the
    /// caller's to change).
    fn dequeue(&mut self, seq: QueueSeq) -> Option<Queued> {
        let queued = self.queue.remove(&seq)?;
        self.expiries
            .remove(&(queued.expires_at, Expiry::Queued(seq)));
        Some(queued)
    }

    /// R-FAIL-1: a re-admission away from a provider, not allowed back to
    /// it, whose pool's other providers are all offline (no node
    /// connection). A first admission, or one that may fall back, waits for
    /// a node to come; an alternate that is online but held out by the
    /// overlay or the health tracker may come back, and is waited for.
    fn has_nowhere_to_go(&self, request: &DispatchRequest) -> bool {
        let Some(avoided) = request.avoid_provider_id.as_ref() else {
            return false;
        };
        !request.allow_avoided_fallback
            && request
                .pool
                .iter()
                .filter(|id| *id != avoided)
                .filter_map(|id| self.providers.get(id))
                .all(|p| p.online.is_none())
    }

    /// R-SEL-1: prefer a runtime-eligible alternate; the avoided provider
    /// only with the fallback flag and only when no eligible alternate
    /// exists. Among candidates with room: least loaded, then pool order.
    fn select(&self, request: &DispatchRequest) -> Option<ProviderId> {
        let avoided = request.avoid_provider_id.as_ref();
        let alternates: Vec<&ProviderState> = request
            .pool
            .iter()
            .filter(|id| Some(*id) != avoided)
            .filter_map(|id| self.providers.get(id))
            .filter(|p| p.selectable())
            .collect();
        if !alternates.is_empty() {
            return alternates
                .into_iter()
                .filter(|p| p.has_room())
                // Least loaded: in_use/capacity compared without floats.
                .min_by(|a, b| {
                    (u64::from(a.in_use) * u64::from(b.spec.capacity))
                        .cmp(&(u64::from(b.in_use) * u64::from(a.spec.capacity)))
                })
                .map(|p| p.spec.id.clone());
        }
        let avoided = avoided?;
        if !request.allow_avoided_fallback || !request.pool.contains(avoided) {
            return None;
        }
        self.providers
            .get(avoided)
            .filter(|p| p.selectable() && p.has_room())
            .map(|p| p.spec.id.clone())
    }

    fn try_lease(&mut self, now: Instant, request: &DispatchRequest) -> Option<Lease> {
        let id = self.select(request)?;
        let provider = self.providers.get_mut(&id)?;
        let generation = provider.online?;
        debug_assert!(provider.in_use < provider.spec.capacity);
        provider.in_use += 1;
        let lease = Lease {
            lease_id: self.next_lease_id,
            request_id: request.request_id,
            provider_id: id,
            adapter: provider.spec.adapter,
            target: provider.spec.target.clone(),
            node: provider.spec.node.clone(),
            generation,
            run_id: self.next_run_id,
            // R-SEL-2: the winning candidate's, kept through re-resolution.
            stall_timeout_ms: request
                .stall_timeout_ms
                .unwrap_or(provider.spec.stall_timeout_ms),
        };
        self.next_lease_id += 1;
        self.next_run_id += 1;
        self.leases_granted += 1;
        self.requests
            .insert(request.request_id, RequestSlot::Held(lease.lease_id));
        self.held.insert(
            lease.lease_id,
            Held {
                lease: lease.clone(),
                request: request.clone(),
                expires_at: now + self.config.queue_timeout,
            },
        );
        Some(lease)
    }

    /// Hold one unit of `provider_id`'s capacity for the parked run `key`,
    /// reported by `node` registering `generation` (R-PARK-2), until
    /// `expires_at`: the run's provider call is going on, so the capacity is
    /// in use before any lease names it. Refused past the provider's
    /// capacity.
    pub fn hold(
        &mut self,
        key: RunKey,
        provider_id: &ProviderId,
        generation: Generation,
        expires_at: Instant,
    ) -> Result<(), HoldRefusal> {
        let node = self
            .providers
            .get(provider_id)
            .ok_or(HoldRefusal::UnknownProvider)?
            .spec
            .node
            .clone();
        if let Some(held) = self.holds.get(&(node.clone(), key)) {
            return if held.provider_id == *provider_id {
                Ok(())
            } else {
                Err(HoldRefusal::KeyInUse)
            };
        }
        let provider = self
            .providers
            .get_mut(provider_id)
            .ok_or(HoldRefusal::UnknownProvider)?;
        if !provider.has_room() {
            return Err(HoldRefusal::NoRoom);
        }
        provider.in_use += 1;
        self.expiries
            .insert((expires_at, Expiry::Hold(node.clone(), key)));
        self.holds.insert(
            (node, key),
            Hold {
                provider_id: provider_id.clone(),
                node: provider.spec.node.clone(),
                generation,
                expires_at,
            },
        );
        Ok(())
    }

    /// Turn the hold of parked run `key` into a lease for `request`, on the
    /// provider's online generation (R-PARK-2): the run is adopted. The
    /// capacity counted stays the same.
    pub fn adopt(
        &mut self,
        now: Instant,
        node: &NodeId,
        key: RunKey,
        request: DispatchRequest,
    ) -> Result<Lease, HoldRefusal> {
        let held_key = (node.clone(), key);
        let hold = self.holds.get(&held_key).ok_or(HoldRefusal::NoHold)?;
        let provider = self
            .providers
            .get(&hold.provider_id)
            .ok_or(HoldRefusal::UnknownProvider)?;
        if provider.online != Some(hold.generation) {
            return Err(HoldRefusal::NotOnline);
        }
        if self.requests.contains_key(&request.request_id) {
            return Err(HoldRefusal::NoHold);
        }
        let hold = self.holds.remove(&held_key).ok_or(HoldRefusal::NoHold)?;
        self.expiries
            .remove(&(hold.expires_at, Expiry::Hold(held_key.0, key)));
        let lease = Lease {
            lease_id: self.next_lease_id,
            request_id: request.request_id,
            provider_id: hold.provider_id,
            adapter: provider.spec.adapter,
            target: provider.spec.target.clone(),
            node: provider.spec.node.clone(),
            generation: hold.generation,
            run_id: self.next_run_id,
            stall_timeout_ms: request
                .stall_timeout_ms
                .unwrap_or(provider.spec.stall_timeout_ms),
        };
        self.next_lease_id += 1;
        self.next_run_id += 1;
        self.leases_granted += 1;
        self.requests
            .insert(request.request_id, RequestSlot::Held(lease.lease_id));
        self.held.insert(
            lease.lease_id,
            Held {
                lease: lease.clone(),
                request,
                expires_at: now + self.config.queue_timeout,
            },
        );
        Ok(lease)
    }

    /// Let go of a hold (its run ended or was refused); the queue may move.
    pub fn release_hold(&mut self, now: Instant, node: &NodeId, key: RunKey) {
        if let Some(hold) = self.holds.remove(&(node.clone(), key)) {
            self.expiries
                .remove(&(hold.expires_at, Expiry::Hold(node.clone(), key)));
            if let Some(p) = self.providers.get_mut(&hold.provider_id) {
                p.in_use = p.in_use.saturating_sub(1);
            }
            self.queue_may_move(now);
        }
    }

    /// Parked runs whose capacity is held.
    pub fn holds(&self) -> usize {
        self.holds.len()
    }

    /// A held lease.
    pub fn lease(&self, lease_id: LeaseId) -> Option<&Lease> {
        self.held.get(&lease_id).map(|h| &h.lease)
    }

    /// The lease currently serving `request_id`.
    pub fn lease_of_request(&self, request_id: RequestId) -> Option<&Lease> {
        match self.requests.get(&request_id)? {
            RequestSlot::Held(lease_id) => self.lease(*lease_id),
            RequestSlot::Queued(_) => None,
        }
    }

    /// Release a lease exactly once (R-LEASE-2). A second release is an
    /// error and changes nothing.
    pub fn release(
        &mut self,
        now: Instant,
        lease_id: LeaseId,
        _reason: ReleaseReason,
    ) -> Result<Lease, NotHeld> {
        let held = self.held.remove(&lease_id).ok_or(NotHeld(lease_id))?;
        let request_id = held.request.request_id;
        if self.requests.get(&request_id) == Some(&RequestSlot::Held(lease_id)) {
            self.requests.remove(&request_id);
        }
        let planted = self.planted_any();
        if let Some(p) = self.providers.get_mut(&held.lease.provider_id) {
            // Never negative: a held lease always counted one (unless a
            // planted bug broke the count on purpose).
            debug_assert!(p.in_use > 0 || planted);
            p.in_use = p.in_use.saturating_sub(1);
        }
        self.leases_released += 1;
        self.queue_may_move(now);
        Ok(held.lease)
    }

    /// R-GEN-4: right before sending, check the lease's generation is still
    /// the online one. If not, release it and re-resolve the request at the
    /// head of the queue, keeping its effective stall timeout (R-SEL-2).
    pub fn pre_send(&mut self, now: Instant, lease_id: LeaseId) -> PreSend {
        #[cfg(feature = "planted-bugs")]
        if self.planted.has(PlantedBug::SkipPreSendFence) {
            // Planted: no re-check at all, not even whether the lease is
            // still held.
            if let Some(held) = self.held.get(&lease_id) {
                return PreSend::Send(held.lease.clone());
            }
            if let Some(lease) = self.planted_fenced.remove(&lease_id) {
                return PreSend::Send(lease);
            }
        }
        let Some(held) = self.held.get(&lease_id) else {
            return PreSend::UnknownLease;
        };
        let online = self
            .providers
            .get(&held.lease.provider_id)
            .and_then(|p| p.online);
        if online == Some(held.lease.generation) {
            return PreSend::Send(held.lease.clone());
        }
        let mut request = held.request.clone();
        request.stall_timeout_ms = Some(held.lease.stall_timeout_ms);
        let expires_at = held.expires_at;
        if self
            .release(now, lease_id, ReleaseReason::PreSendFence)
            .is_ok()
        {
            match self.try_lease(now, &request) {
                Some(lease) => self.events.push_back(AdmissionEvent::Leased(lease)),
                None => self.enqueue(request, expires_at, QueueEnd::Head),
            }
        }
        PreSend::Refenced
    }

    /// The client went away: drop its queue entry or release its lease.
    /// Returns the released lease (so the driver can cancel the node run).
    pub fn cancel(&mut self, now: Instant, request_id: RequestId) -> Option<Lease> {
        match self.requests.get(&request_id).copied()? {
            RequestSlot::Queued(seq) => {
                self.requests.remove(&request_id);
                self.dequeue(seq);
                None
            }
            RequestSlot::Held(lease_id) => self
                .release(now, lease_id, ReleaseReason::ClientCancel)
                .ok(),
        }
    }

    /// `provider`'s node is dispatchable on `generation` (or on nothing).
    /// The queue is served at the next [`Self::poll_event`].
    pub fn set_online(
        &mut self,
        now: Instant,
        provider: &ProviderId,
        generation: Option<Generation>,
    ) {
        if let Some(p) = self.providers.get_mut(provider) {
            p.online = generation;
        }
        self.queue_may_move(now);
    }

    /// Set several providers' online generation and eligibility at once.
    /// The queue is served at the next [`Self::poll_event`], after all of
    /// them are in their new state (R-SEL-1: an avoided provider must not
    /// win because its alternate came online a moment later).
    pub fn set_states(&mut self, now: Instant, updates: &[(ProviderId, Option<Generation>, bool)]) {
        for (provider, online, eligible) in updates {
            if let Some(p) = self.providers.get_mut(provider) {
                p.online = *online;
                p.runtime_eligible = *eligible;
            }
        }
        self.queue_may_move(now);
    }

    /// `provider`'s capacity as its node reports it (`capacity_from_node`
    /// providers, whose Edge configuration gives none).
    pub fn set_capacity(&mut self, now: Instant, provider: &ProviderId, capacity: u32) {
        if let Some(p) = self.providers.get_mut(provider) {
            // At least one: a provider is configured to take work.
            p.spec.capacity = capacity.max(1);
        }
        // Leases held above a lowered capacity stay; no new one is granted
        // until they fall under it (R-LEASE-2: capacity never goes
        // negative). A raised capacity may serve the queue.
        self.queue_may_move(now);
    }

    /// Whether the runtime overlay and health tracker allow `provider`.
    /// The queue is served at the next [`Self::poll_event`], so the other
    /// changes of the same input (another provider's recovery in the same
    /// CAPABILITIES answer) land first (R-SEL-1).
    pub fn set_runtime_eligible(&mut self, now: Instant, provider: &ProviderId, eligible: bool) {
        if let Some(p) = self.providers.get_mut(provider) {
            p.runtime_eligible = eligible;
        }
        self.queue_may_move(now);
    }

    /// Something changed that may let a queued request be served: serve
    /// the queue at the next [`Self::poll_event`], not in the middle of
    /// the caller's input.
    fn queue_may_move(&mut self, now: Instant) {
        self.serve_queue_at = Some(now);
    }

    /// R-GEN-3: release every lease bound to `node`'s `generation` exactly
    /// once and take that node's providers offline.
    pub fn fence(&mut self, now: Instant, node: &NodeId, generation: Generation) {
        for p in self.providers.values_mut() {
            if &p.spec.node == node && p.online == Some(generation) {
                p.online = None;
            }
        }
        // Holds taken for runs that generation reported go with it.
        let gone: Vec<RunKey> = self
            .holds
            .iter()
            .filter(|(_, h)| &h.node == node && h.generation == generation)
            .map(|((_, k), _)| *k)
            .collect();
        for key in gone {
            self.release_hold(now, node, key);
        }
        let fenced: Vec<LeaseId> = self
            .held
            .values()
            .filter(|h| &h.lease.node == node && h.lease.generation == generation)
            .map(|h| h.lease.lease_id)
            .collect();
        for lease_id in fenced {
            if let Ok(lease) = self.release(now, lease_id, ReleaseReason::Fenced) {
                #[cfg(feature = "planted-bugs")]
                self.planted_after_fence(&lease);
                self.events.push_back(AdmissionEvent::LeaseFenced(lease));
            }
        }
    }

    #[cfg(feature = "planted-bugs")]
    fn planted_after_fence(&mut self, lease: &Lease) {
        if self.planted.has(PlantedBug::DoubleRelease) {
            // Planted: the lease's capacity is given back a second time.
            if let Some(p) = self.providers.get_mut(&lease.provider_id) {
                p.in_use = p.in_use.saturating_sub(1);
            }
            self.leases_released += 1;
        }
        if self.planted.has(PlantedBug::SkipPreSendFence) {
            if self.planted_fenced.len() >= PLANTED_FENCED_REMEMBERED {
                self.planted_fenced.pop_first();
            }
            self.planted_fenced.insert(lease.lease_id, lease.clone());
        }
    }

    /// Serve queued requests in FIFO order wherever capacity allows. Stops
    /// as soon as no provider has room: a full Edge's release serves the
    /// first request it can and does not walk the rest of a long queue.
    fn drain_queue(&mut self, now: Instant) {
        let mut next = self.queue.keys().next().copied();
        while let Some(seq) = next {
            if !self
                .providers
                .values()
                .any(|p| p.selectable() && p.has_room())
            {
                return;
            }
            next = self
                .queue
                .range((Bound::Excluded(seq), Bound::Unbounded))
                .next()
                .map(|(seq, _)| *seq);
            let Some(request) = self.queue.get(&seq).map(|q| &q.request) else {
                continue;
            };
            if !request.pool.iter().any(|p| self.providers.contains_key(p)) {
                let request_id = request.request_id;
                self.dequeue(seq);
                self.requests.remove(&request_id);
                self.events
                    .push_back(AdmissionEvent::QueueExpired { request_id });
                continue;
            }
            let request = request.clone();
            if let Some(lease) = self.try_lease(now, &request) {
                self.dequeue(seq);
                self.events.push_back(AdmissionEvent::Leased(lease));
            }
        }
    }

    /// Expire queued requests whose wait passed, and holds no request
    /// adopted in time.
    pub fn handle_timeout(&mut self, now: Instant) {
        // Earliest first; at one instant, queued requests in queue order.
        while self.expiries.first().is_some_and(|(at, _)| *at <= now) {
            let Some((_, expiry)) = self.expiries.pop_first() else {
                break;
            };
            match expiry {
                Expiry::Hold(node, key) => self.release_hold(now, &node, key),
                Expiry::Queued(seq) => {
                    if let Some(q) = self.dequeue(seq) {
                        self.requests.remove(&q.request.request_id);
                        self.events.push_back(AdmissionEvent::QueueExpired {
                            request_id: q.request.request_id,
                        });
                    }
                }
            }
        }
    }

    /// When the next queued request or hold expires.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.expiries.first().map(|(at, _)| *at)
    }

    /// Next event, until `None`. Call it after the input's changes are all
    /// applied: the first call serves the queue (FIFO, wherever capacity
    /// allows) on the state as it is now, once for any number of changes
    /// (R-SEL-1: selection never sees half of an input).
    #[must_use]
    pub fn poll_event(&mut self) -> Option<AdmissionEvent> {
        if let Some(now) = self.serve_queue_at.take() {
            self.drain_queue(now);
        }
        self.events.pop_front()
    }

    /// The requests waiting in the queue, oldest first (for the simulator's
    /// checks and the status surface).
    pub fn queued_requests(&self) -> impl Iterator<Item = &DispatchRequest> {
        self.queue.values().map(|q| &q.request)
    }

    /// Is `provider` online and runtime-eligible right now?
    pub fn is_selectable(&self, provider: &ProviderId) -> bool {
        self.providers.get(provider).is_some_and(|p| p.selectable())
    }

    /// Requests waiting.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    /// Is `request_id` waiting in the queue?
    pub fn is_queued(&self, request_id: RequestId) -> bool {
        matches!(self.requests.get(&request_id), Some(RequestSlot::Queued(_)))
    }

    /// Leases held, all providers.
    pub fn leases_in_use(&self) -> usize {
        self.held.len()
    }

    /// Leases granted and released since start.
    pub fn lease_totals(&self) -> (u64, u64) {
        (self.leases_granted, self.leases_released)
    }

    /// Per-provider capacity.
    pub fn capacity_view(&self) -> Vec<ProviderCapacityView> {
        self.providers
            .values()
            .map(|p| ProviderCapacityView {
                provider_id: p.spec.id.clone(),
                in_use: p.in_use,
                capacity: p.spec.capacity,
                online: p.online,
                runtime_eligible: p.runtime_eligible,
            })
            .collect()
    }

    /// Check internal consistency (used by tests and the simulator):
    /// each provider's `in_use` equals its held leases and never exceeds
    /// its capacity.
    pub fn check_invariants(&self) -> Result<(), String> {
        for p in self.providers.values() {
            let held = self
                .held
                .values()
                .filter(|h| h.lease.provider_id == p.spec.id)
                .count() as u64
                + self
                    .holds
                    .values()
                    .filter(|h| h.provider_id == p.spec.id)
                    .count() as u64;
            if u64::from(p.in_use) != held {
                return Err(format!(
                    "provider {} counts {} in use but holds {held} leases and parked runs",
                    p.spec.id, p.in_use
                ));
            }
            if p.in_use > p.spec.capacity {
                return Err(format!(
                    "provider {} over capacity: {} > {}",
                    p.spec.id, p.in_use, p.spec.capacity
                ));
            }
        }
        #[cfg(feature = "planted-bugs")]
        if self.leases_released > self.leases_granted {
            return Err("released more leases than were granted".into());
        }
        if self.leases_granted - self.leases_released != self.held.len() as u64 {
            return Err("granted - released != held".into());
        }
        self.check_request_index()
    }

    /// The request index names exactly the queued and held requests, each
    /// in its one place.
    fn check_request_index(&self) -> Result<(), String> {
        if self.requests.len() != self.queue.len() + self.held.len() {
            return Err(format!(
                "request index has {} entries for {} queued and {} held",
                self.requests.len(),
                self.queue.len(),
                self.held.len()
            ));
        }
        for (seq, q) in &self.queue {
            if self.requests.get(&q.request.request_id) != Some(&RequestSlot::Queued(*seq)) {
                return Err(format!(
                    "queued request {} is not indexed at its place",
                    q.request.request_id
                ));
            }
            if !self
                .expiries
                .contains(&(q.expires_at, Expiry::Queued(*seq)))
            {
                return Err(format!(
                    "queued request {} has no deadline",
                    q.request.request_id
                ));
            }
        }
        for ((node, key), hold) in &self.holds {
            if !self
                .expiries
                .contains(&(hold.expires_at, Expiry::Hold(node.clone(), *key)))
            {
                return Err(format!("the hold of {key:?} has no deadline"));
            }
        }
        if self.expiries.len() != self.queue.len() + self.holds.len() {
            return Err(format!(
                "{} deadlines for {} queued and {} holds",
                self.expiries.len(),
                self.queue.len(),
                self.holds.len()
            ));
        }
        for (lease_id, h) in &self.held {
            if self.requests.get(&h.request.request_id) != Some(&RequestSlot::Held(*lease_id)) {
                return Err(format!(
                    "request {} is not indexed as holding lease {lease_id}",
                    h.request.request_id
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: &str, node: &str, capacity: u32) -> ProviderSpec {
        ProviderSpec {
            id: ProviderId::from(id),
            node: NodeId::from(node),
            adapter: AdapterKind::Mock,
            target: id.into(),
            capacity,
            stall_timeout_ms: 1000,
        }
    }

    fn ms(v: u64) -> Instant {
        Instant::from_millis(v)
    }

    fn pool(ids: &[&str]) -> Vec<ProviderId> {
        ids.iter().map(|s| ProviderId::from(*s)).collect()
    }

    fn admission(specs: Vec<ProviderSpec>) -> Admission {
        let mut a = Admission::new(
            AdmissionConfig {
                queue_capacity: 2,
                queue_timeout: Duration::from_millis(100),
            },
            specs.clone(),
        );
        for s in specs {
            a.set_online(ms(0), &s.id, Some(1));
        }
        a
    }

    fn leased(a: Admit) -> Lease {
        match a {
            Admit::Leased(l) => l,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    #[test]
    fn capacity_is_respected_then_queue_then_429() {
        let mut a = admission(vec![spec("p", "n", 1)]);
        let l1 = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(2, pool(&["p"]))),
            Admit::Queued
        );
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(3, pool(&["p"]))),
            Admit::Queued
        );
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(4, pool(&["p"]))),
            Admit::Rejected(AdmitRejection::QueueFull)
        );
        a.release(ms(1), l1.lease_id, ReleaseReason::Terminal)
            .unwrap();
        match a.poll_event() {
            Some(AdmissionEvent::Leased(l)) => assert_eq!(l.request_id, 2, "FIFO"),
            other => panic!("{other:?}"),
        }
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_readmission_whose_only_alternates_are_offline_is_refused_at_once_r_fail_1() {
        let mut a = admission(vec![spec("down", "n1", 1), spec("sick", "n2", 1)]);
        a.set_online(ms(0), &ProviderId::from("down"), None);
        let readmit = |id, fallback| DispatchRequest {
            avoid_provider_id: Some(ProviderId::from("sick")),
            allow_avoided_fallback: fallback,
            ..DispatchRequest::new(id, pool(&["down", "sick"]))
        };
        assert_eq!(
            a.request(ms(0), readmit(1, false)),
            Admit::Rejected(AdmitRejection::NoAlternate)
        );
        // One that may go back to the avoided provider is served by it.
        leased(a.request(ms(0), readmit(2, true)));
        // A first admission waits for a node to come, as before.
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(3, pool(&["down", "sick"]))),
            Admit::Queued
        );
        // An alternate online but full: the re-admission waits for room.
        a.set_online(ms(0), &ProviderId::from("down"), Some(1));
        let _held = leased(a.request(ms(0), DispatchRequest::new(4, pool(&["down"]))));
        assert_eq!(a.request(ms(0), readmit(5, false)), Admit::Queued);
        a.check_invariants().unwrap();
    }

    #[test]
    fn each_lease_is_released_exactly_once() {
        let mut a = admission(vec![spec("p", "n", 2)]);
        let l = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        assert!(
            a.release(ms(0), l.lease_id, ReleaseReason::Terminal)
                .is_ok()
        );
        assert_eq!(
            a.release(ms(0), l.lease_id, ReleaseReason::Terminal),
            Err(NotHeld(l.lease_id))
        );
        assert_eq!(a.leases_in_use(), 0);
        a.check_invariants().unwrap();
    }

    #[test]
    fn queued_request_expires_after_queue_timeout() {
        let mut a = admission(vec![spec("p", "n", 1)]);
        leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        assert_eq!(
            a.request(ms(10), DispatchRequest::new(2, pool(&["p"]))),
            Admit::Queued
        );
        assert_eq!(a.poll_timeout(), Some(ms(110)));
        a.handle_timeout(ms(109));
        assert_eq!(a.poll_event(), None);
        a.handle_timeout(ms(110));
        assert_eq!(
            a.poll_event(),
            Some(AdmissionEvent::QueueExpired { request_id: 2 })
        );
    }

    #[test]
    fn fence_releases_every_lease_of_that_generation_once_and_only_those() {
        let mut a = admission(vec![spec("p", "n", 2), spec("q", "m", 2)]);
        let lp = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        let lq = leased(a.request(ms(0), DispatchRequest::new(2, pool(&["q"]))));
        a.fence(ms(1), &NodeId::from("n"), 1);
        assert_eq!(
            a.poll_event(),
            Some(AdmissionEvent::LeaseFenced(lp.clone()))
        );
        assert_eq!(a.poll_event(), None);
        assert!(a.lease(lq.lease_id).is_some(), "other node untouched");
        // A late terminal for the fenced lease finds nothing to release.
        assert!(
            a.release(ms(2), lp.lease_id, ReleaseReason::Terminal)
                .is_err()
        );
        // Fencing again is a no-op.
        a.fence(ms(3), &NodeId::from("n"), 1);
        assert_eq!(a.poll_event(), None);
        a.check_invariants().unwrap();
    }

    #[test]
    fn pre_send_fence_releases_a_stale_lease_and_re_resolves() {
        let mut a = admission(vec![spec("p", "n", 1), spec("q", "m", 1)]);
        let l = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        assert_eq!(l.stall_timeout_ms, 1000);
        // The node reconnected: generation 2 is now online.
        a.set_online(ms(1), &ProviderId::from("p"), Some(2));
        assert_eq!(a.pre_send(ms(2), l.lease_id), PreSend::Refenced);
        match a.poll_event() {
            Some(AdmissionEvent::Leased(n)) => {
                assert_eq!(n.generation, 2);
                assert_ne!(n.lease_id, l.lease_id);
                assert_eq!(n.stall_timeout_ms, 1000, "R-SEL-2 kept");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.leases_in_use(), 1);
        a.check_invariants().unwrap();
    }

    #[test]
    fn not_online_provider_is_never_selected() {
        let mut a = admission(vec![spec("p", "n", 1)]);
        a.set_online(ms(0), &ProviderId::from("p"), None);
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))),
            Admit::Queued
        );
        a.set_online(ms(5), &ProviderId::from("p"), Some(3));
        match a.poll_event() {
            Some(AdmissionEvent::Leased(l)) => assert_eq!(l.generation, 3),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn avoided_provider_is_skipped_when_an_eligible_alternate_exists() {
        let mut a = admission(vec![spec("p", "n", 1), spec("q", "m", 1)]);
        let mut r = DispatchRequest::new(1, pool(&["p", "q"]));
        r.avoid_provider_id = Some(ProviderId::from("p"));
        r.allow_avoided_fallback = true;
        let l = leased(a.request(ms(0), r));
        assert_eq!(l.provider_id, ProviderId::from("q"));
    }

    #[test]
    fn avoided_provider_waits_for_a_busy_alternate_rather_than_fall_back() {
        let mut a = admission(vec![spec("p", "n", 1), spec("q", "m", 1)]);
        leased(a.request(ms(0), DispatchRequest::new(1, pool(&["q"]))));
        let mut r = DispatchRequest::new(2, pool(&["p", "q"]));
        r.avoid_provider_id = Some(ProviderId::from("p"));
        r.allow_avoided_fallback = true;
        assert_eq!(a.request(ms(0), r), Admit::Queued);
    }

    #[test]
    fn avoided_provider_is_chosen_only_with_the_flag_and_no_alternate() {
        let mut a = admission(vec![spec("p", "n", 1), spec("q", "m", 1)]);
        a.set_runtime_eligible(ms(0), &ProviderId::from("q"), false);
        let mut r = DispatchRequest::new(1, pool(&["p", "q"]));
        r.avoid_provider_id = Some(ProviderId::from("p"));
        assert_eq!(a.request(ms(0), r.clone()), Admit::Queued, "no flag: wait");
        a.cancel(ms(0), 1);
        r.allow_avoided_fallback = true;
        let l = leased(a.request(ms(0), r));
        assert_eq!(l.provider_id, ProviderId::from("p"));
    }

    #[test]
    fn selection_prefers_the_least_loaded_candidate() {
        let mut a = admission(vec![spec("p", "n", 2), spec("q", "m", 2)]);
        let first = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p", "q"]))));
        let second = leased(a.request(ms(0), DispatchRequest::new(2, pool(&["p", "q"]))));
        assert_ne!(first.provider_id, second.provider_id);
    }

    #[test]
    fn least_loaded_compares_load_ratios_not_counts() {
        // q (capacity 4) holds 1 lease: 1/4 loaded; p (capacity 1) is idle:
        // 0/1. p is the less loaded one although q has more free slots.
        let mut a = admission(vec![spec("p", "n", 1), spec("q", "m", 4)]);
        let q = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["q"]))));
        assert_eq!(q.provider_id, ProviderId::from("q"));
        let next = leased(a.request(ms(0), DispatchRequest::new(2, pool(&["p", "q"]))));
        assert_eq!(next.provider_id, ProviderId::from("p"));
        // Now p is full (1/1) and q is 1/4: q.
        let last = leased(a.request(ms(0), DispatchRequest::new(3, pool(&["p", "q"]))));
        assert_eq!(last.provider_id, ProviderId::from("q"));
        // r (capacity 4) holds 1: 1/4; s (capacity 2) holds 1: 1/2. r wins
        // from either end of the pool.
        let mut a = admission(vec![spec("r", "n", 4), spec("s", "m", 2)]);
        leased(a.request(ms(0), DispatchRequest::new(1, pool(&["r"]))));
        leased(a.request(ms(0), DispatchRequest::new(2, pool(&["s"]))));
        for (id, order) in [(3, ["r", "s"]), (4, ["s", "r"])] {
            let l = leased(a.request(ms(0), DispatchRequest::new(id, pool(&order))));
            assert_eq!(l.provider_id, ProviderId::from("r"), "{order:?}");
            a.release(ms(0), l.lease_id, ReleaseReason::Terminal)
                .expect("held");
        }
    }

    #[test]
    fn each_lease_gets_its_own_lease_and_run_id_and_the_counters_follow() {
        let mut a = admission(vec![spec("p", "n", 2)]);
        let first = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        let second = leased(a.request(ms(0), DispatchRequest::new(2, pool(&["p"]))));
        assert_ne!(first.lease_id, second.lease_id);
        assert_ne!(first.run_id, second.run_id);
        assert_eq!(a.lease_totals(), (2, 0));
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(3, pool(&["p"]))),
            Admit::Queued
        );
        assert_eq!(a.queue_depth(), 1);
        let queued: Vec<RequestId> = a.queued_requests().map(|r| r.request_id).collect();
        assert_eq!(queued, vec![3]);
        a.release(ms(1), first.lease_id, ReleaseReason::Terminal)
            .expect("held");
        assert_eq!(a.lease_totals(), (2, 1), "served at the next poll");
        let third = match a.poll_event() {
            Some(AdmissionEvent::Leased(l)) => l,
            other => panic!("expected the queued request's lease, got {other:?}"),
        };
        assert_eq!(third.request_id, 3);
        assert!(third.run_id != first.run_id && third.run_id != second.run_id);
        assert_eq!(a.lease_totals(), (3, 1));
        assert_eq!(a.queue_depth(), 0);
    }

    #[test]
    fn an_adopted_run_gets_its_own_lease_and_run_id_r_park_2() {
        let mut a = admission(vec![spec("p", "n", 3)]);
        let first = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        let key = RunKey {
            generation: 1,
            run_id: 77,
        };
        a.hold(key, &ProviderId::from("p"), 1, ms(50))
            .expect("room for the parked run");
        let adopted = a
            .adopt(
                ms(1),
                &NodeId::from("n"),
                key,
                DispatchRequest::new(2, pool(&["p"])),
            )
            .expect("held and online");
        let after = leased(a.request(ms(2), DispatchRequest::new(3, pool(&["p"]))));
        let leases = [first.lease_id, adopted.lease_id, after.lease_id];
        let runs = [first.run_id, adopted.run_id, after.run_id];
        for i in 0..3 {
            for j in i + 1..3 {
                assert_ne!(leases[i], leases[j], "lease ids {leases:?}");
                assert_ne!(runs[i], runs[j], "run ids {runs:?}");
            }
        }
        assert!(leases[0] < leases[1] && leases[1] < leases[2], "{leases:?}");
        assert!(runs[0] < runs[1] && runs[1] < runs[2], "{runs:?}");
        assert_eq!(a.lease_totals(), (3, 0));
        assert_eq!(a.holds(), 0);
    }

    /// R-MULTI-1, R-PARK-2: two Edges' runs on one node may share a run
    /// key; a hold of that key for one provider is not taken to be the
    /// other's, whose adoption would then journal the wrong provider.
    #[test]
    fn a_run_key_held_for_one_provider_is_refused_for_another() {
        let mut a = admission(vec![spec("p", "n", 2), spec("q", "n", 2)]);
        let key = RunKey {
            generation: 1,
            run_id: 1,
        };
        a.hold(key, &ProviderId::from("p"), 1, ms(50)).unwrap();
        assert_eq!(a.hold(key, &ProviderId::from("p"), 1, ms(50)), Ok(()));
        assert_eq!(
            a.hold(key, &ProviderId::from("q"), 1, ms(50)),
            Err(HoldRefusal::KeyInUse)
        );
        assert_eq!(a.holds(), 1);
    }

    /// R-PARK-2 (hostile nodes): a hold is its node's and run's together,
    /// so a node that reports another node's run key first neither takes
    /// that node's hold nor, when its own is let go, releases it.
    #[test]
    fn a_node_naming_another_nodes_run_key_neither_takes_nor_releases_its_hold() {
        let mut a = admission(vec![spec("p", "n", 2), spec("q", "m", 2)]);
        let key = RunKey {
            generation: 4,
            run_id: 9,
        };
        // m (hostile) names n's run first; n's own report is still held.
        a.hold(key, &ProviderId::from("q"), 1, ms(50)).unwrap();
        assert_eq!(a.hold(key, &ProviderId::from("p"), 1, ms(50)), Ok(()));
        assert_eq!(a.holds(), 2);
        a.release_hold(ms(1), &NodeId::from("m"), key);
        assert_eq!(a.holds(), 1);
        let adopted = a
            .adopt(
                ms(1),
                &NodeId::from("n"),
                key,
                DispatchRequest::new(1, pool(&["p"])),
            )
            .expect("n's hold survives m's release");
        assert_eq!(adopted.node, NodeId::from("n"));
        assert!(a.check_invariants().is_ok());
    }

    #[test]
    fn a_fence_releases_only_that_nodes_holds_of_that_generation_r_gen_3() {
        let mut a = admission(vec![spec("p", "n", 2), spec("q", "m", 2)]);
        let key = |run_id| RunKey {
            generation: 1,
            run_id,
        };
        // n's run on generation 1, n's on generation 2 (a later
        // registration), and m's on generation 1 (the same number).
        a.hold(key(1), &ProviderId::from("p"), 1, ms(50)).unwrap();
        a.hold(key(2), &ProviderId::from("p"), 2, ms(50)).unwrap();
        a.hold(key(3), &ProviderId::from("q"), 1, ms(50)).unwrap();
        a.fence(ms(1), &NodeId::from("n"), 1);
        assert_eq!(a.holds(), 2, "only n's generation-1 hold goes");
        assert_eq!(
            a.adopt(
                ms(1),
                &NodeId::from("n"),
                key(1),
                DispatchRequest::new(1, pool(&["p"]))
            ),
            Err(HoldRefusal::NoHold)
        );
        let kept = a
            .adopt(
                ms(1),
                &NodeId::from("m"),
                key(3),
                DispatchRequest::new(3, pool(&["q"])),
            )
            .expect("m's hold and provider survive n's fence");
        assert_eq!(kept.provider_id, ProviderId::from("q"));
    }

    /// The self-check the tests and the simulator use as an oracle passes
    /// every reachable state and fails each corruption of the counts.
    #[test]
    fn the_self_check_holds_on_real_states_and_finds_each_corruption() {
        // A lease granted and released, and a parked run's hold, on p;
        // nothing on q.
        let state = || {
            let mut a = admission(vec![spec("p", "n", 3), spec("q", "m", 3)]);
            assert_eq!(a.check_invariants(), Ok(()));
            let l = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
            let key = RunKey {
                generation: 1,
                run_id: 9,
            };
            a.hold(key, &ProviderId::from("p"), 1, ms(50)).unwrap();
            assert_eq!(a.check_invariants(), Ok(()), "a lease and a hold");
            a.release(ms(1), l.lease_id, ReleaseReason::Terminal)
                .expect("held");
            assert_eq!(a.lease_totals(), (1, 1));
            a
        };
        assert_eq!(state().check_invariants(), Ok(()), "granted == released");

        let mut miscounted = state();
        miscounted
            .providers
            .get_mut(&ProviderId::from("p"))
            .unwrap()
            .in_use += 1;
        assert!(miscounted.check_invariants().is_err(), "in use off by one");
        let mut lost_hold = state();
        lost_hold.holds.clear();
        assert!(lost_hold.check_invariants().is_err(), "a hold not counted");
        let mut stray = state();
        stray.requests.insert(42, RequestSlot::Queued(0));
        assert!(
            stray.check_invariants().is_err(),
            "an indexed request in no place"
        );
        // Only built with the planted bugs, which can over-release.
        #[cfg(feature = "planted-bugs")]
        {
            let mut over_released = state();
            over_released.leases_released += 1;
            assert!(
                over_released.check_invariants().is_err(),
                "released > granted"
            );
        }
    }

    #[test]
    fn a_fence_takes_only_that_nodes_providers_offline() {
        // Both nodes happen to be on generation 1: fencing n's generation 1
        // leaves m's provider online (R-GEN-3 is per node).
        let mut a = admission(vec![spec("p", "n", 1), spec("q", "m", 1)]);
        a.fence(ms(0), &NodeId::from("n"), 1);
        assert!(!a.is_selectable(&ProviderId::from("p")));
        assert!(a.is_selectable(&ProviderId::from("q")));
    }

    #[test]
    fn release_reasons_and_config_are_what_was_given() {
        let labels = [
            ReleaseReason::Terminal,
            ReleaseReason::Fenced,
            ReleaseReason::ClientCancel,
            ReleaseReason::PreSendFence,
            ReleaseReason::Deadline,
        ]
        .map(ReleaseReason::as_str);
        assert_eq!(
            labels,
            [
                "terminal",
                "fenced",
                "client_cancel",
                "pre_send_fence",
                "deadline"
            ]
        );
        let a = admission(vec![spec("p", "n", 1)]);
        assert_eq!(
            a.config(),
            AdmissionConfig {
                queue_capacity: 2,
                queue_timeout: Duration::from_millis(100),
            }
        );
    }

    #[test]
    fn client_cancel_releases_the_lease_or_drops_the_queue_entry() {
        let mut a = admission(vec![spec("p", "n", 1)]);
        let l = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(2, pool(&["p"]))),
            Admit::Queued
        );
        a.cancel(ms(1), 2);
        assert_eq!(a.queue_depth(), 0);
        assert_eq!(a.cancel(ms(1), 1).map(|x| x.lease_id), Some(l.lease_id));
        assert_eq!(a.leases_in_use(), 0);
        assert_eq!(a.poll_event(), None, "the dropped entry is not served");
    }

    #[test]
    fn a_request_id_is_a_duplicate_exactly_while_it_is_queued_or_holds_a_lease() {
        let mut a = admission(vec![spec("p", "n", 1), spec("q", "m", 1)]);
        let dup = Admit::Rejected(AdmitRejection::DuplicateRequest);
        let l1 = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        assert_eq!(a.request(ms(0), DispatchRequest::new(1, pool(&["q"]))), dup);
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(2, pool(&["p"]))),
            Admit::Queued
        );
        assert_eq!(a.request(ms(0), DispatchRequest::new(2, pool(&["q"]))), dup);
        assert!(a.is_queued(2));
        assert_eq!(a.lease_of_request(1), Some(&l1));
        assert_eq!(a.lease_of_request(2), None);
        a.check_invariants().unwrap();

        // Released by its terminal: request 2 moves from the queue to the
        // lease, and id 1 is free again.
        a.release(ms(1), l1.lease_id, ReleaseReason::Terminal)
            .unwrap();
        let l2 = match a.poll_event() {
            Some(AdmissionEvent::Leased(l)) => l,
            other => panic!("{other:?}"),
        };
        assert_eq!(l2.request_id, 2);
        assert!(!a.is_queued(2));
        assert_eq!(a.lease_of_request(2), Some(&l2));
        assert_eq!(a.request(ms(1), DispatchRequest::new(2, pool(&["q"]))), dup);
        let again = leased(a.request(ms(1), DispatchRequest::new(1, pool(&["q"]))));
        a.check_invariants().unwrap();

        // R-GEN-4: re-resolved by the pre-send fence, still the same request.
        a.set_online(ms(2), &ProviderId::from("p"), Some(2));
        assert_eq!(a.pre_send(ms(2), l2.lease_id), PreSend::Refenced);
        let l2b = match a.poll_event() {
            Some(AdmissionEvent::Leased(l)) => l,
            other => panic!("{other:?}"),
        };
        assert_eq!(l2b.request_id, 2);
        assert_eq!(a.request(ms(2), DispatchRequest::new(2, pool(&["q"]))), dup);
        a.check_invariants().unwrap();

        // Canceled, expired or released: free again.
        assert_eq!(a.cancel(ms(3), 1).map(|l| l.lease_id), Some(again.lease_id));
        assert_eq!(
            a.request(ms(3), DispatchRequest::new(3, pool(&["p"]))),
            Admit::Queued
        );
        a.handle_timeout(ms(103));
        assert_eq!(
            a.poll_event(),
            Some(AdmissionEvent::QueueExpired { request_id: 3 })
        );
        a.check_invariants().unwrap();
        for id in [1, 3] {
            let l = leased(a.request(ms(4), DispatchRequest::new(id, pool(&["q"]))));
            a.release(ms(4), l.lease_id, ReleaseReason::Terminal)
                .unwrap();
        }
        a.fence(ms(5), &NodeId::from("n"), 2);
        assert_eq!(a.poll_event(), Some(AdmissionEvent::LeaseFenced(l2b)));
        assert_eq!(a.cancel(ms(5), 2), None);
        leased(a.request(ms(5), DispatchRequest::new(2, pool(&["q"]))));
        a.check_invariants().unwrap();
    }

    /// A full queue whose requests all wait out their time at once is
    /// emptied in one call, in queue order; a release on a full Edge serves
    /// the first request that fits and leaves the rest where they were.
    #[test]
    fn a_long_queue_expires_in_order_and_a_release_serves_its_head() {
        let n = 10_000u64;
        let mut a = Admission::new(
            AdmissionConfig {
                queue_capacity: n as usize,
                queue_timeout: Duration::from_millis(100),
            },
            vec![spec("p", "n", 1)],
        );
        a.set_online(ms(0), &ProviderId::from("p"), Some(1));
        let first = leased(a.request(ms(0), DispatchRequest::new(0, pool(&["p"]))));
        for id in 1..=n {
            assert_eq!(
                a.request(ms(id / 1000), DispatchRequest::new(id, pool(&["p"]))),
                Admit::Queued
            );
        }
        assert_eq!(a.poll_timeout(), Some(ms(100)));
        a.release(ms(20), first.lease_id, ReleaseReason::Terminal)
            .unwrap();
        let served = match a.poll_event() {
            Some(AdmissionEvent::Leased(l)) => l,
            other => panic!("{other:?}"),
        };
        assert_eq!(served.request_id, 1, "FIFO");
        assert_eq!(a.poll_event(), None);
        assert_eq!(a.queue_depth(), n as usize - 1);
        a.check_invariants().unwrap();
        // Every deadline up to 107 ms has passed: requests 2..=7999.
        a.handle_timeout(ms(107));
        let expired: Vec<RequestId> = std::iter::from_fn(|| a.poll_event())
            .map(|e| match e {
                AdmissionEvent::QueueExpired { request_id } => request_id,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(expired, (2..8000).collect::<Vec<_>>());
        assert_eq!(a.poll_timeout(), Some(ms(108)));
        assert_eq!(a.queued_requests().next().map(|r| r.request_id), Some(8000));
        a.check_invariants().unwrap();
    }

    /// R-GEN-4: a request re-resolved after its lease was fenced goes back
    /// ahead of those waiting, with the deadline it had.
    #[test]
    fn a_refenced_request_waits_at_the_head_with_its_own_deadline() {
        let mut a = admission(vec![spec("p", "n", 1)]);
        let l1 = leased(a.request(ms(0), DispatchRequest::new(1, pool(&["p"]))));
        assert_eq!(
            a.request(ms(30), DispatchRequest::new(2, pool(&["p"]))),
            Admit::Queued
        );
        // The node's connection is gone before request 1 was sent.
        a.set_online(ms(40), &ProviderId::from("p"), None);
        assert_eq!(a.pre_send(ms(40), l1.lease_id), PreSend::Refenced);
        assert_eq!(a.poll_event(), None);
        let order: Vec<RequestId> = a.queued_requests().map(|r| r.request_id).collect();
        assert_eq!(order, vec![1, 2], "the re-resolved one first");
        assert_eq!(a.poll_timeout(), Some(ms(100)), "request 1's own deadline");
        a.check_invariants().unwrap();
        // Back online: served in that order.
        a.set_online(ms(50), &ProviderId::from("p"), Some(2));
        match a.poll_event() {
            Some(AdmissionEvent::Leased(l)) => assert_eq!(l.request_id, 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(a.poll_timeout(), Some(ms(130)));
        a.handle_timeout(ms(130));
        assert_eq!(
            a.poll_event(),
            Some(AdmissionEvent::QueueExpired { request_id: 2 })
        );
        a.check_invariants().unwrap();
    }

    #[test]
    fn unknown_pool_is_no_route_and_duplicate_ids_are_refused() {
        let mut a = admission(vec![spec("p", "n", 1)]);
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(1, pool(&["zzz"]))),
            Admit::Rejected(AdmitRejection::NoRoute)
        );
        leased(a.request(ms(0), DispatchRequest::new(2, pool(&["p"]))));
        assert_eq!(
            a.request(ms(0), DispatchRequest::new(2, pool(&["p"]))),
            Admit::Rejected(AdmitRejection::DuplicateRequest)
        );
    }

    /// The deadlines index follows the queue and the holds through any
    /// sequence of inputs: the next deadline is always the earliest of
    /// theirs, and none has passed once its time was handled.
    mod deadlines {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Request(u64, bool),
            Release(usize),
            Cancel(u64),
            Hold(u64, bool, u64),
            ReleaseHold(u64),
            Adopt(u64, u64),
            Online(bool, Option<u64>),
            PreSend(usize),
            Advance(u64),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0u64..24, any::<bool>()).prop_map(|(id, p)| Op::Request(id, p)),
                2 => (0usize..8).prop_map(Op::Release),
                1 => (0u64..24).prop_map(Op::Cancel),
                2 => (0u64..8, any::<bool>(), 1u64..120).prop_map(|(r, p, t)| Op::Hold(r, p, t)),
                1 => (0u64..8).prop_map(Op::ReleaseHold),
                1 => (0u64..8, 0u64..24).prop_map(|(r, id)| Op::Adopt(r, id)),
                1 => (any::<bool>(), proptest::option::of(1u64..4))
                    .prop_map(|(p, g)| Op::Online(p, g)),
                1 => (0usize..8).prop_map(Op::PreSend),
                3 => (0u64..60).prop_map(Op::Advance),
            ]
        }

        fn provider(p: bool) -> ProviderId {
            ProviderId::from(if p { "p" } else { "q" })
        }

        proptest! {
            #[test]
            fn the_next_deadline_is_the_earliest_and_none_outlives_its_time(
                ops in proptest::collection::vec(op(), 1..150)
            ) {
                let mut a = Admission::new(
                    AdmissionConfig {
                        queue_capacity: 6,
                        queue_timeout: Duration::from_millis(50),
                    },
                    vec![spec("p", "n", 2), spec("q", "m", 1)],
                );
                a.set_online(ms(0), &provider(true), Some(1));
                a.set_online(ms(0), &provider(false), Some(1));
                let mut now = 0;
                for op in ops {
                    let at = ms(now);
                    match op {
                        Op::Request(id, p) => {
                            let _ = a.request(at, DispatchRequest::new(id, vec![provider(p)]));
                        }
                        Op::Release(i) => {
                            if let Some(id) = a.held.keys().nth(i) {
                                let id = *id;
                                let _ = a.release(at, id, ReleaseReason::Terminal);
                            }
                        }
                        Op::Cancel(id) => {
                            let _ = a.cancel(at, id);
                        }
                        Op::Hold(run, p, ttl) => {
                            let generation = a.providers[&provider(p)].online.unwrap_or(1);
                            let key = RunKey { generation, run_id: run };
                            let _ = a.hold(key, &provider(p), generation, ms(now + ttl));
                        }
                        Op::ReleaseHold(run) => {
                            let found = a.holds.keys().find(|(_, k)| k.run_id == run).cloned();
                            if let Some((node, key)) = found {
                                a.release_hold(at, &node, key);
                            }
                        }
                        Op::Adopt(run, id) => {
                            let found = a.holds.keys().find(|(_, k)| k.run_id == run).cloned();
                            if let Some((node, key)) = found {
                                let request = DispatchRequest::new(id, pool(&["p", "q"]));
                                let _ = a.adopt(at, &node, key, request);
                            }
                        }
                        Op::Online(p, generation) => a.set_online(at, &provider(p), generation),
                        Op::PreSend(i) => {
                            if let Some(id) = a.held.keys().nth(i) {
                                let id = *id;
                                let _ = a.pre_send(at, id);
                            }
                        }
                        Op::Advance(dt) => {
                            now += dt;
                            a.handle_timeout(ms(now));
                            prop_assert!(a.queue.values().all(|q| q.expires_at > ms(now)));
                            prop_assert!(a.holds.values().all(|h| h.expires_at > ms(now)));
                        }
                    }
                    while a.poll_event().is_some() {}
                    a.check_invariants().map_err(TestCaseError::fail)?;
                    let earliest = a
                        .queue
                        .values()
                        .map(|q| q.expires_at)
                        .chain(a.holds.values().map(|h| h.expires_at))
                        .min();
                    prop_assert_eq!(a.poll_timeout(), earliest);
                }
            }
        }
    }
}
