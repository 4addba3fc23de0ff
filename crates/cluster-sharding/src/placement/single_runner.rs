//! One runner that owns every shard, with its shard locks held in a [`RunnerStorage`]
//! (reference `SingleRunner`): a complete deployment for one process, started by
//! [`Sharding::single_runner`](crate::Sharding::single_runner).
//!
//! Its life:
//!
//! - **Start.** It registers itself in the runner registry and takes the lock of every shard
//!   of its groups.
//!   It fails if another live runner holds any: two processes on one database must not both
//!   deliver.
//! - **Run.** It refreshes the locks every shard lock interval.
//! - **Shutdown.** Once its entities have stopped, it releases the locks and unregisters.
//!
//! Several runners sharing the shards (membership, rebalancing, handoff) are the multi-runner
//! runtime's job.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::sync::lock;
use cluster_core::{RunnerAddress, ShardId};
use tokio_util::sync::CancellationToken;

use crate::runtime::delivery::ReadLatch;
use crate::runtime::registry::Managers;

/// Shards and registration a single runner holds, released at shutdown.
///
/// The runner serves a shard only while its lease is confirmed.
///
/// - **Confirmed.** A refresh that returned the shard was sent less than
///   `shard_lock_expiration` minus a margin ago.
/// - **Why it is safe.** A lease is taken over only once it expired.
///   So no other runner can have taken a confirmed shard.
/// - **Fencing.** The same check fences the runner's final replies, without a storage call of
///   its own.
///   On SQLite a handler's transaction holds the file's write lock, which a refresh would wait
///   for.
pub(crate) struct HeldLocks {
    runners: Arc<dyn RunnerStorage>,
    address: RunnerAddress,
    shards: Vec<ShardId>,
    /// How long a lease holds after the refresh that confirmed it was sent, margin taken off.
    lease: Duration,
    state: Mutex<LockState>,
    /// Every shard is held and its lease is confirmed.
    /// Each delivery reads this first.
    serving_all: AtomicBool,
    /// When the lease of the last refresh that answered ends, in nanoseconds since `origin`
    /// (0 when no lease holds): what [`HeldLocks::delivers`] reads without a lock.
    lease_ends: AtomicU64,
    /// The instant `lease_ends` counts from.
    origin: tokio::time::Instant,
    released: AtomicBool,
}

/// What the lock refresh acts on when it finds locks lost or taken back.
pub(crate) struct LockedRuntime {
    /// The entities of a lost shard stop.
    pub(crate) managers: Arc<Managers>,
    /// The claims on a taken-back shard's messages are released.
    pub(crate) messages: Arc<dyn MessageStorage>,
    /// The read loop reads a shard served again at once.
    pub(crate) read_latch: Arc<ReadLatch>,
}

/// What the refreshes found.
#[derive(Default)]
struct LockState {
    /// When the last refresh that answered was sent.
    confirmed_at: Option<tokio::time::Instant>,
    /// The shards that refresh did not return: another runner took them.
    lost: BTreeSet<ShardId>,
}

impl HeldLocks {
    pub(crate) fn new(
        runners: Arc<dyn RunnerStorage>,
        address: RunnerAddress,
        shards: Vec<ShardId>,
        config: &cluster_core::ShardingConfig,
        acquired_at: tokio::time::Instant,
    ) -> HeldLocks {
        let lease = crate::placement::lock_lease(config);
        HeldLocks {
            runners,
            address,
            shards,
            lease,
            state: Mutex::new(LockState { confirmed_at: Some(acquired_at), lost: BTreeSet::new() }),
            serving_all: AtomicBool::new(true),
            // The acquisition confirmed every lock at `origin`.
            lease_ends: AtomicU64::new(u64::try_from(lease.as_nanos()).unwrap_or(u64::MAX)),
            origin: acquired_at,
            released: AtomicBool::new(false),
        }
    }

    fn state(&self) -> MutexGuard<'_, LockState> {
        lock(&self.state)
    }

    /// Whether the runner serves `shard`.
    ///
    /// It does when the shard's lock was not lost and, as of the last refresh, its lease is
    /// confirmed.
    /// Every delivery reads this, so the common case is one atomic load.
    pub(crate) fn serves(&self, shard: &ShardId) -> bool {
        self.serving_all.load(Ordering::Acquire) || self.confirms(shard)
    }

    /// Whether a request of `shard` may be handed to an entity now: the runner serves it, and
    /// its lease has not lapsed since the last refresh.
    ///
    /// A runner frozen past the lease may have lost the locks without knowing yet, and its
    /// refreshes have not said so: [`serves`](HeldLocks::serves) still holds until one answers.
    /// The common case is two atomic loads and a clock read.
    pub(crate) fn delivers(&self, shard: &ShardId) -> bool {
        if !self.serving_all.load(Ordering::Acquire) {
            return self.confirms(shard);
        }
        let now = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        now < self.lease_ends.load(Ordering::Acquire)
    }

    /// Whether `shard`'s lease is confirmed now, so that a final reply may be stored.
    ///
    /// It is when the shard's lock was not lost, and the last refresh that answered was sent
    /// less than the lease ago.
    pub(crate) fn confirms(&self, shard: &ShardId) -> bool {
        let state = self.state();
        state.is_confirmed(self.lease) && !state.lost.contains(shard)
    }

    /// The shards served now, or `None` when that is all of them.
    ///
    /// The lease is checked here, not only by the refreshes: a runner frozen past it reads
    /// nothing until a refresh answers.
    pub(crate) fn served(&self) -> Option<Vec<ShardId>> {
        let state = self.state();
        if !state.is_confirmed(self.lease) {
            return Some(Vec::new());
        }
        if self.serving_all.load(Ordering::Acquire) {
            return None;
        }
        Some(self.shards.iter().filter(|shard| !state.lost.contains(*shard)).cloned().collect())
    }

    /// Refreshes the locks every `interval` until `shutdown`.
    ///
    /// - **Lost locks.** A lock the refresh does not return was taken by another runner.
    ///   That runner is a misconfigured second runner on the same database, or one that found
    ///   this runner's leases expired.
    ///   The runner stops serving the shard, with an error event and
    ///   `effect_cluster_shard_locks_lost_total`.
    ///   It interrupts the shard's entities, and takes the lock back once it is free.
    /// - **Failed refreshes.** While refreshes fail, the shards are served until their leases
    ///   could have expired.
    ///   Then they are not served until a refresh answers again.
    pub(crate) async fn refresh(
        self: Arc<HeldLocks>,
        runtime: LockedRuntime,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
            let sent_at = tokio::time::Instant::now();
            let refresh = self.runners.refresh(&self.address, &self.shards);
            let stopped = match tokio::time::timeout(interval, refresh).await {
                Ok(Ok(held)) => self.refreshed(sent_at, &held, &runtime),
                Ok(Err(error)) => self.unconfirmed(&error.to_string()),
                Err(_) => self.unconfirmed("the refresh timed out"),
            };
            for shard in &stopped {
                runtime.managers.stop_shard(shard, true, Duration::ZERO).await;
            }
            self.take_back(&runtime).await;
        }
    }

    /// A refresh sent at `sent_at` returned `held`.
    ///
    /// The shards it left out are lost.
    /// They are returned, so that their entities stop.
    fn refreshed(
        &self,
        sent_at: tokio::time::Instant,
        held: &[ShardId],
        runtime: &LockedRuntime,
    ) -> Vec<ShardId> {
        let mut state = self.state();
        let resumed = !state.is_confirmed(self.lease);
        state.confirmed_at = Some(sent_at);
        let lost: Vec<ShardId> = self
            .shards
            .iter()
            .filter(|shard| !held.contains(shard) && !state.lost.contains(*shard))
            .cloned()
            .collect();
        if !lost.is_empty() {
            tracing::error!(
                lost = lost.len(),
                total = self.shards.len(),
                "shard locks were lost to another runner; their shards are no longer served here"
            );
            let n_lost = u64::try_from(lost.len()).unwrap_or(u64::MAX);
            metrics::counter!(crate::metrics::SHARD_LOCKS_LOST).increment(n_lost);
            state.lost.extend(lost.iter().cloned());
        }
        self.publish(&state);
        if resumed {
            tracing::info!("the shard locks are confirmed again");
            runtime.read_latch.wake();
        }
        lost
    }

    /// A refresh failed.
    ///
    /// Once the leases could have expired, no shard is served (reported once).
    /// The shards served until then are returned, so that their entities stop.
    fn unconfirmed(&self, why: &str) -> Vec<ShardId> {
        tracing::warn!(why, "could not refresh the shard locks");
        let mut state = self.state();
        if state.confirmed_at.is_none() || state.is_confirmed(self.lease) {
            return Vec::new();
        }
        tracing::error!(
            why,
            "the shard locks cannot be confirmed; no shard is served until they are"
        );
        state.confirmed_at = None;
        self.publish(&state);
        self.shards.iter().filter(|shard| !state.lost.contains(*shard)).cloned().collect()
    }

    /// Takes back the lost locks that are free again.
    async fn take_back(&self, runtime: &LockedRuntime) {
        let lost: Vec<ShardId> = self.state().lost.iter().cloned().collect();
        if lost.is_empty() {
            return;
        }
        let Ok(acquired) = self.runners.acquire(&self.address, &lost).await else { return };
        if acquired.is_empty() {
            return;
        }
        // The other runner's claims on these shards' messages are released, as on start.
        if let Err(error) = runtime.messages.reset_shards(&acquired).await {
            tracing::warn!(%error, "could not release the claims of the shards taken back");
        }
        let mut state = self.state();
        for shard in &acquired {
            state.lost.remove(shard);
        }
        tracing::info!(shards = acquired.len(), "shard locks taken back");
        self.publish(&state);
        drop(state);
        runtime.read_latch.wake();
    }

    /// Publishes what the refreshes found to the deliveries and the `effect_cluster_shards` gauge.
    fn publish(&self, state: &LockState) {
        let confirmed = state.is_confirmed(self.lease);
        let ends = state.confirmed_at.filter(|_| confirmed).map_or(0, |at| {
            let ends = at.saturating_duration_since(self.origin).saturating_add(self.lease);
            u64::try_from(ends.as_nanos()).unwrap_or(u64::MAX)
        });
        self.lease_ends.store(ends, Ordering::Release);
        self.serving_all.store(confirmed && state.lost.is_empty(), Ordering::Release);
        let served = if confirmed { self.shards.len() - state.lost.len() } else { 0 };
        crate::metrics::set(crate::metrics::SHARDS, served);
    }

    /// Releases every lock and unregisters the runner, once.
    ///
    /// Errors are logged: the locks expire.
    pub(crate) async fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Err(error) = self.runners.release_all(&self.address).await {
            tracing::warn!(%error, "could not release the shard locks; they expire");
        }
        if let Err(error) = self.runners.unregister(&self.address).await {
            tracing::warn!(%error, "could not unregister the runner");
        }
    }
}

impl LockState {
    fn is_confirmed(&self, lease: Duration) -> bool {
        self.confirmed_at.is_some_and(|at| at.elapsed() < lease)
    }
}

/// Every shard of `groups`.
pub(crate) fn all_shards(
    groups: &BTreeSet<cluster_core::ShardGroup>,
    shards_per_group: u32,
) -> Vec<ShardId> {
    groups
        .iter()
        .flat_map(|group| (1..=shards_per_group).map(move |id| ShardId::new(group.clone(), id)))
        .collect()
}
