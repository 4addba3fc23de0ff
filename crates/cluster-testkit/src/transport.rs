//! An in-memory runner-to-runner transport: several runtimes in one process reach each other
//! through a [`MemoryNetwork`], which implements the `Runners` contract (reference §1.5)
//! without sockets. Calls go straight to the peer's `RunnerHandler`; dropping a call drops the
//! peer's reply stream, which interrupts a volatile request there, as a real connection does.
//!
//! Faults: a runner can be cut off (every call to it fails with `RunnerUnavailable`, like a
//! dead peer), and the next calls of a kind to a runner can be made to fail once.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cluster_core::RunnerAddress;
use cluster_core::envelope::{Envelope, Reply, Request};
use cluster_core::error::ClusterError;
use cluster_core::future::BoxFuture;
use cluster_core::runners::{ReplyStream, RunnerHandler, Runners};

/// The runners of one process, by address.
#[derive(Default)]
pub struct MemoryNetwork {
    state: Mutex<State>,
    notifies: AtomicU32,
    sends: AtomicU32,
}

#[derive(Default)]
struct State {
    handlers: BTreeMap<RunnerAddress, Arc<dyn RunnerHandler>>,
    /// Calls of these kinds to these runners fail this many more times.
    failing: BTreeMap<(RunnerAddress, Call), u32>,
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The critical sections only insert, read or remove map entries.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
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
        lock(&self.state).handlers.insert(address, handler);
    }

    /// Cuts the runner at `address` off: calls to it fail with `RunnerUnavailable`.
    pub fn detach(&self, address: &RunnerAddress) {
        lock(&self.state).handlers.remove(address);
    }

    /// The next `times` calls of kind `call` to `address` fail with `RunnerUnavailable`.
    pub fn fail_next(&self, address: RunnerAddress, call: Call, times: u32) {
        lock(&self.state).failing.insert((address, call), times);
    }

    /// How many `notify` calls were made, failed ones included.
    pub fn notifies(&self) -> u32 {
        self.notifies.load(Ordering::Acquire)
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

    /// A `Runners` client on this network.
    pub fn runners(self: &Arc<MemoryNetwork>) -> Arc<dyn Runners> {
        Arc::new(MemoryRunners { network: Arc::clone(self) })
    }
}

/// The client side of a [`MemoryNetwork`].
#[derive(Debug)]
struct MemoryRunners {
    network: Arc<MemoryNetwork>,
}

impl Runners for MemoryRunners {
    fn ping<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move { self.network.peer(address, Call::Request).map(|_| ()) })
    }

    fn notify<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            self.network.notifies.fetch_add(1, Ordering::AcqRel);
            let peer = self.network.peer(address, Call::Notify)?;
            peer.notify(envelope, persisted).await
        })
    }

    fn send<'a>(
        &'a self,
        address: &'a RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'a, Result<Reply, ClusterError>> {
        Box::pin(async move {
            self.network.sends.fetch_add(1, Ordering::AcqRel);
            let peer = self.network.peer(address, Call::Request)?;
            let mut replies = peer.request(request, persisted).await?;
            loop {
                match replies.next_reply().await {
                    Some(Ok(reply)) if reply.is_final() => return Ok(reply),
                    Some(Ok(_chunk)) => {}
                    Some(Err(error)) => return Err(error),
                    None => {
                        return Err(ClusterError::RunnerUnavailable { address: address.clone() });
                    }
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
        Box::pin(async move {
            self.network.sends.fetch_add(1, Ordering::AcqRel);
            let peer = self.network.peer(address, Call::Request)?;
            peer.request(request, persisted).await
        })
    }

    fn send_envelope<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let peer = self.network.peer(address, Call::Envelope)?;
            peer.envelope(envelope, persisted).await
        })
    }

    fn on_runner_unavailable(&self, _address: &RunnerAddress) {}
}
