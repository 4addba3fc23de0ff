//! An in-memory runner-to-runner transport: several runtimes in one process reach each other
//! through a [`MemoryNetwork`], which implements the `Transport` contract
//! (`effect/src/cluster/Runners.ts`) without sockets. Calls go straight to the peer's
//! `RunnerHandler`; dropping a call drops the peer's reply stream, which interrupts a volatile
//! request there, as a real connection does.
//!
//! Limits: each process's calls in flight to each peer can be bounded as one connection of the
//! TCP transport bounds them ([`Slots`]), pushed persisted requests in a lane of their own.
//!
//! Faults: a runner can be cut off (every call to it fails with `RunnerUnavailable`, like a
//! dead peer), the next calls of a kind to a runner can be made to fail once, and
//! [`NetworkFaults`] delay, lose and duplicate calls at random (from a seed, so a simulation
//! stays deterministic): a lost call is a connection that broke before or after the peer got
//! it (the caller sees `RunnerUnavailable`, as over TCP), a duplicated call reaches the peer
//! twice (the second copy's replies go nowhere).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::RunnerAddress;
use cluster_core::envelope::{Envelope, Reply, Request};
use cluster_core::error::ClusterError;
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::transport::{Probe, ReplyStream, RunnerHandler, Transport};

use crate::sim::SimRng;

/// The runners of one process, by address.
#[derive(Default)]
pub struct MemoryNetwork {
    state: Mutex<State>,
    notifies: AtomicU32,
    sends: AtomicU32,
    lost: AtomicU32,
    duplicated: AtomicU32,
    /// Woken by [`MemoryNetwork::cut_calls_to`].
    cut: tokio::sync::Notify,
    replies_lost: AtomicU32,
}

/// How many calls one process may have in flight to one peer, as one connection of the TCP
/// transport allows (`cluster_rpc::RpcConfig`), while set (see [`MemoryNetwork::bound_slots`]).
///
/// A call holds its slot until its final answer (a stream's, until the stream is dropped).
/// As over TCP, the calls take slots in two lanes:
///
/// - pings, notices, envelopes and volatile requests wait for a free slot of `calls`
///   (`max_in_flight`);
/// - pushed persisted requests, which last as long as their handlers run, take a slot of
///   `pushed` (`max_pushed_in_flight`), and fail at once (`RunnerUnavailable`) when none is
///   free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slots {
    /// Calls in flight from one process to one peer, pushed persisted requests apart.
    pub calls: usize,
    /// Pushed persisted requests in flight from one process to one peer.
    pub pushed: usize,
}

/// Random transport faults, applied to every call while set (see
/// [`MemoryNetwork::set_faults`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetworkFaults {
    /// The shortest delay before a call reaches its peer.
    pub delay_min: Duration,
    /// The longest delay before a call reaches its peer.
    pub delay_max: Duration,
    /// How many calls in a thousand break (half before the peer gets them, half after).
    pub loss_per_mille: u64,
    /// How many calls in a thousand reach the peer twice.
    pub duplicate_per_mille: u64,
}

/// What happens to one call.
#[derive(Clone, Copy, Debug, Default)]
struct Fate {
    delay: Duration,
    /// The call breaks before the peer gets it.
    lost_before: bool,
    /// The call breaks after the peer got it (its reply is lost).
    lost_after: bool,
    duplicated: bool,
}

#[derive(Default)]
struct State {
    handlers: BTreeMap<RunnerAddress, Arc<dyn RunnerHandler>>,
    /// Calls of these kinds to these runners fail this many more times.
    failing: BTreeMap<(RunnerAddress, Call), u32>,
    /// Random faults and their source.
    faults: Option<(NetworkFaults, SimRng)>,
    /// How many pings each address was sent, failed ones included.
    pings: BTreeMap<RunnerAddress, u32>,
    /// The final replies of this many more `send` calls to each address are lost.
    losing_replies: BTreeMap<RunnerAddress, u32>,
    /// How often the calls to each address were cut.
    cuts: BTreeMap<RunnerAddress, u64>,
    /// The slots of each process's calls to each peer, when bounded.
    slots: Option<Slots>,
    /// The addresses whose process is gone: probes find them refusing connections.
    refusing: BTreeSet<RunnerAddress>,
    /// How many probes each address was sent.
    probes: BTreeMap<RunnerAddress, u32>,
}

/// A kind of call, for fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Call {
    /// `notify`.
    Notify,
    /// `send` and `stream`.
    Request,
    /// `send_envelope`.
    Envelope,
}

impl fmt::Debug for MemoryNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let runners: Vec<RunnerAddress> = lock(&self.state).handlers.keys().cloned().collect();
        f.debug_struct("MemoryNetwork").field("runners", &runners).finish()
    }
}

impl MemoryNetwork {
    /// An empty network.
    pub fn new() -> Arc<MemoryNetwork> {
        Arc::new(MemoryNetwork::default())
    }

    /// Makes the runner at `address` reachable, served by `handler`.
    pub fn attach(&self, address: RunnerAddress, handler: Arc<dyn RunnerHandler>) {
        let mut state = lock(&self.state);
        state.refusing.remove(&address);
        state.handlers.insert(address, handler);
    }

    /// The process of the runner at `address` is gone (killed): calls to it fail with
    /// `RunnerUnavailable`, and probes find its address refusing connections, until it is
    /// attached again. A detached runner ([`MemoryNetwork::detach`]) is unreachable, not gone.
    pub fn refuse(&self, address: &RunnerAddress) {
        let mut state = lock(&self.state);
        state.handlers.remove(address);
        state.refusing.insert(address.clone());
    }

    /// How many probes `address` was sent.
    pub fn probes_to(&self, address: &RunnerAddress) -> u32 {
        lock(&self.state).probes.get(address).copied().unwrap_or(0)
    }

    /// Cuts the runner at `address` off: calls to it fail with `RunnerUnavailable`.
    pub fn detach(&self, address: &RunnerAddress) {
        lock(&self.state).handlers.remove(address);
    }

    /// The next `times` calls of kind `call` to `address` fail with `RunnerUnavailable`.
    pub fn fail_next(&self, address: RunnerAddress, call: Call, times: u32) {
        lock(&self.state).failing.insert((address, call), times);
    }

    /// The next `times` `send` calls to `address` reach it and run, but their final replies are
    /// lost on the way back: the caller gets `RunnerUnavailable`.
    pub fn lose_next_replies(&self, address: RunnerAddress, times: u32) {
        lock(&self.state).losing_replies.insert(address, times);
    }

    /// How many final replies [`lose_next_replies`](MemoryNetwork::lose_next_replies) lost.
    pub fn replies_lost(&self) -> u32 {
        self.replies_lost.load(Ordering::Acquire)
    }

    /// Breaks the `send` calls to `address` waiting for their replies now (a connection that
    /// goes away): their callers get `RunnerUnavailable`, and the peer sees them dropped.
    pub fn cut_calls_to(&self, address: &RunnerAddress) {
        *lock(&self.state).cuts.entry(address.clone()).or_default() += 1;
        self.cut.notify_waiters();
    }

    fn cuts_of(&self, address: &RunnerAddress) -> u64 {
        lock(&self.state).cuts.get(address).copied().unwrap_or(0)
    }

    /// Whether the next final reply from `address` is to be lost (and counts it).
    fn loses_reply(&self, address: &RunnerAddress) -> bool {
        let mut state = lock(&self.state);
        match state.losing_replies.get_mut(address) {
            Some(left) if *left > 0 => {
                *left -= 1;
                self.replies_lost.fetch_add(1, Ordering::AcqRel);
                true
            }
            _ => false,
        }
    }

    /// Bounds the calls each process has in flight to each peer, as a TCP connection does.
    /// Transports made afterwards keep these slots.
    pub fn bound_slots(&self, slots: Slots) {
        lock(&self.state).slots = Some(slots);
    }

    /// Delays, loses and duplicates calls at random from now on, every choice drawn from
    /// `seed`.
    pub fn set_faults(&self, faults: NetworkFaults, seed: u64) {
        lock(&self.state).faults = Some((faults, SimRng::new(seed)));
    }

    /// Stops the random faults of [`set_faults`](MemoryNetwork::set_faults).
    pub fn clear_faults(&self) {
        lock(&self.state).faults = None;
    }

    /// How many calls the random faults broke.
    pub fn lost(&self) -> u32 {
        self.lost.load(Ordering::Acquire)
    }

    /// How many calls the random faults delivered twice.
    pub fn duplicated(&self) -> u32 {
        self.duplicated.load(Ordering::Acquire)
    }

    /// Draws what happens to the next call.
    fn fate(&self) -> Fate {
        let mut state = lock(&self.state);
        let Some((faults, rng)) = &mut state.faults else { return Fate::default() };
        let delay = rng.duration(faults.delay_min, faults.delay_max);
        let lost = rng.below(1_000) < faults.loss_per_mille;
        let before = rng.below(2) == 0;
        let duplicated = !lost && rng.below(1_000) < faults.duplicate_per_mille;
        if lost {
            self.lost.fetch_add(1, Ordering::AcqRel);
        }
        if duplicated {
            self.duplicated.fetch_add(1, Ordering::AcqRel);
        }
        Fate { delay, lost_before: lost && before, lost_after: lost && !before, duplicated }
    }

    /// Waits out `fate`'s delay, then finds the peer, unless the call breaks before reaching
    /// it.
    async fn reach(
        &self,
        address: &RunnerAddress,
        call: Call,
        fate: Fate,
    ) -> Result<Arc<dyn RunnerHandler>, ClusterError> {
        if !fate.delay.is_zero() {
            tokio::time::sleep(fate.delay).await;
        }
        if fate.lost_before {
            return Err(ClusterError::RunnerUnavailable { address: address.clone() });
        }
        self.peer(address, call)
    }

    /// How many `notify` calls were made, failed ones included.
    pub fn notifies(&self) -> u32 {
        self.notifies.load(Ordering::Acquire)
    }

    /// How many pings were sent to `address`, failed ones included.
    pub fn pings_to(&self, address: &RunnerAddress) -> u32 {
        lock(&self.state).pings.get(address).copied().unwrap_or(0)
    }

    /// How many `send` and `stream` calls were made, failed ones included.
    pub fn sends(&self) -> u32 {
        self.sends.load(Ordering::Acquire)
    }

    /// The handler of `address` for a call of kind `call`, or why there is none.
    fn peer(
        &self,
        address: &RunnerAddress,
        call: Call,
    ) -> Result<Arc<dyn RunnerHandler>, ClusterError> {
        let mut state = lock(&self.state);
        let key = (address.clone(), call);
        if let Some(left) = state.failing.get_mut(&key)
            && *left > 0
        {
            *left -= 1;
            return Err(ClusterError::RunnerUnavailable { address: address.clone() });
        }
        state
            .handlers
            .get(address)
            .cloned()
            .ok_or_else(|| ClusterError::RunnerUnavailable { address: address.clone() })
    }

    /// A `Transport` client on this network: one process's connections.
    pub fn transport(self: &Arc<MemoryNetwork>) -> Arc<dyn Transport> {
        let slots = lock(&self.state).slots;
        Arc::new(MemoryTransport {
            network: Arc::clone(self),
            slots,
            peers: Mutex::new(BTreeMap::new()),
        })
    }
}

/// The client side of a [`MemoryNetwork`].
#[derive(Debug)]
struct MemoryTransport {
    network: Arc<MemoryNetwork>,
    /// The bound of this process's calls to each peer, if any.
    slots: Option<Slots>,
    /// The slots of this process's calls to each peer (its connection to it).
    peers: Mutex<BTreeMap<RunnerAddress, Lanes>>,
}

/// The slots of one process's calls to one peer (see [`Slots`]).
#[derive(Debug)]
struct Lanes {
    calls: Arc<tokio::sync::Semaphore>,
    pushed: Arc<tokio::sync::Semaphore>,
}

/// A slot of a call in flight, given back when the call ends (`None`: calls are not bounded).
type Slot = Option<tokio::sync::OwnedSemaphorePermit>;

/// A stream's replies, holding its call's slot until the stream is dropped.
struct SlottedStream {
    replies: Box<dyn ReplyStream>,
    _slot: Slot,
}

impl ReplyStream for SlottedStream {
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>> {
        self.replies.next_reply()
    }
}

impl MemoryTransport {
    /// A slot for a call to `address`: once one is free, or for a pushed persisted request
    /// (`pushed`) one free now.
    async fn slot(&self, address: &RunnerAddress, pushed: bool) -> Result<Slot, ClusterError> {
        let Some(slots) = self.slots else { return Ok(None) };
        let unavailable = || ClusterError::RunnerUnavailable { address: address.clone() };
        let lane = {
            let mut peers = lock(&self.peers);
            let lanes = peers.entry(address.clone()).or_insert_with(|| Lanes {
                calls: Arc::new(tokio::sync::Semaphore::new(slots.calls)),
                pushed: Arc::new(tokio::sync::Semaphore::new(slots.pushed)),
            });
            Arc::clone(if pushed { &lanes.pushed } else { &lanes.calls })
        };
        if pushed {
            return lane.try_acquire_owned().map(Some).map_err(|_| unavailable());
        }
        lane.acquire_owned().await.map(Some).map_err(|_| unavailable())
    }

    /// Delivers an envelope (a `notify` or `send_envelope` call) under the random faults.
    async fn deliver(
        &self,
        address: &RunnerAddress,
        call: Call,
        envelope: Envelope,
        persisted: bool,
    ) -> Result<(), ClusterError> {
        let _slot = self.slot(address, false).await?;
        let fate = self.network.fate();
        let peer = self.network.reach(address, call, fate).await?;
        let send = |envelope| match call {
            Call::Envelope => peer.envelope(envelope, persisted),
            Call::Notify | Call::Request => peer.notify(envelope, persisted),
        };
        if fate.duplicated {
            // The first copy's outcome is not what the caller hears.
            let _ = send(envelope.clone()).await;
        }
        let delivered = send(envelope).await;
        if fate.lost_after {
            return Err(ClusterError::RunnerUnavailable { address: address.clone() });
        }
        delivered
    }

    /// Starts a request (a `send` or `stream` call) under the random faults; its replies hold
    /// the call's slot.
    async fn start(
        &self,
        address: &RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> Result<Box<dyn ReplyStream>, ClusterError> {
        self.network.sends.fetch_add(1, Ordering::AcqRel);
        let slot = self.slot(address, persisted).await?;
        let fate = self.network.fate();
        let peer = self.network.reach(address, Call::Request, fate).await?;
        if fate.duplicated {
            // A second copy runs on the peer; its replies go nowhere.
            let (peer, copy) = (Arc::clone(&peer), request.clone());
            tokio::spawn(async move {
                if let Ok(mut replies) = peer.request(copy, persisted).await {
                    while let Some(Ok(_)) = replies.next_reply().await {}
                }
            });
        }
        let replies = peer.request(request, persisted).await?;
        if fate.lost_after {
            // The connection broke: dropping the stream tells the peer the caller is gone.
            drop(replies);
            return Err(ClusterError::RunnerUnavailable { address: address.clone() });
        }
        Ok(match slot {
            Some(slot) => Box::new(SlottedStream { replies, _slot: Some(slot) }),
            None => replies,
        })
    }
}

impl Transport for MemoryTransport {
    fn ping<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            {
                let mut state = lock(&self.network.state);
                let count = state.pings.entry(address.clone()).or_default();
                *count = count.saturating_add(1);
            }
            let _slot = self.slot(address, false).await?;
            let fate = self.network.fate();
            self.network.reach(address, Call::Request, fate).await?;
            if fate.lost_after {
                return Err(ClusterError::RunnerUnavailable { address: address.clone() });
            }
            Ok(())
        })
    }

    fn notify<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            self.network.notifies.fetch_add(1, Ordering::AcqRel);
            self.deliver(address, Call::Notify, envelope, persisted).await
        })
    }

    fn send<'a>(
        &'a self,
        address: &'a RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'a, Result<Reply, ClusterError>> {
        Box::pin(async move {
            let cuts = self.network.cuts_of(address);
            let mut replies = self.start(address, request, persisted).await?;
            let unavailable = || ClusterError::RunnerUnavailable { address: address.clone() };
            loop {
                // Kept across the wake-ups of cuts to other runners: a reply future dropped
                // half-way loses its reply.
                let next = replies.next_reply();
                tokio::pin!(next);
                let next = loop {
                    let cut = self.network.cut.notified();
                    tokio::pin!(cut);
                    cut.as_mut().enable();
                    if self.network.cuts_of(address) != cuts {
                        return Err(unavailable());
                    }
                    tokio::select! {
                        next = &mut next => break next,
                        () = cut => {}
                    }
                };
                match next {
                    Some(Ok(reply)) if reply.is_final() => {
                        if self.network.loses_reply(address) {
                            return Err(unavailable());
                        }
                        return Ok(reply);
                    }
                    Some(Ok(_chunk)) => {}
                    Some(Err(error)) => return Err(error),
                    None => return Err(unavailable()),
                }
            }
        })
    }

    fn stream<'a>(
        &'a self,
        address: &'a RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'a, Result<Box<dyn ReplyStream>, ClusterError>> {
        Box::pin(async move { self.start(address, request, persisted).await })
    }

    fn send_envelope<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move { self.deliver(address, Call::Envelope, envelope, persisted).await })
    }

    fn on_runner_unavailable(&self, _address: &RunnerAddress) {}

    /// Refused for an address the test made refuse ([`MemoryNetwork::refuse`]), listening for
    /// an attached one, and unknown otherwise (a detached runner is unreachable, not gone).
    fn probe<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, Probe> {
        let mut state = lock(&self.network.state);
        let count = state.probes.entry(address.clone()).or_default();
        *count = count.saturating_add(1);
        let probe = if state.refusing.contains(address) {
            Probe::Refused
        } else if state.handlers.contains_key(address) {
            Probe::Listening
        } else {
            Probe::Unknown
        };
        Box::pin(std::future::ready(probe))
    }
}
