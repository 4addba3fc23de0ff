//! Persisted delivery on one runner (`effect/src/cluster/Sharding.ts`,
//! `effect/src/cluster/MessageStorage.ts`).
//!
//! A persisted request takes these steps:
//!
//! 1. It is saved in [`MessageStorage`] first, deduplicated by its primary key.
//! 2. The storage read loop claims it and hands it to its entity.
//!    A request saved by the runner that serves its shard goes to its entity directly instead
//!    (`direct`).
//!    So does one that another process saved and pushed to this runner (`pushed`).
//! 3. The entity's exit is stored as the request's final reply.
//!
//! A caller in this process waits for the reply in three ways, and the first to answer wins:
//!
//! - on an in-process reply waiter, registered before the save;
//! - on the call that pushed the request to its owner, which answers with the stored reply
//!   (`pushed`);
//! - by polling storage every `entity_reply_poll_interval`, the fallback for a reply saved by
//!   another process or before a restart, or a push that failed.
//!
//! Storage is the source of truth.
//! A request whose runner stops before answering stays stored, and the next run answers it.
//!
//! # Answered once
//!
//! A request is delivered at least once and answered exactly once:
//!
//! - **One final reply.** Storage accepts one final reply per request; a second is a conflict.
//! - **One run per delivery.** A request is claimed here before it reaches its entity
//!   (`tracked`).
//!   The read loop, direct delivery and a re-run each skip a request claimed here.
//! - **Fencing.** A handler's final reply is stored only once the shard's lock is confirmed
//!   (`Shards::confirm`).
//!   Otherwise the reply is not stored, the claim is released, and the shard's next owner runs
//!   the request.
//!   That may be this runner, when only the confirmation failed: if a second confirmation
//!   finds the lock held, its read loop is woken.
//! - **Drained releases.** A shard's release waits until the requests taken up in it are
//!   settled (`writes::WriteGuard`), for a bounded time.
//!   So a request that finishes while its shard drains is answered here.
//! - **Fenced retries.** A handler's final reply whose write failed is retried only after the
//!   lock is confirmed again.
//!
//! A handler can still run more than once for one request.
//! That happens when its runner dies before the reply is stored, or when its reply is fenced.

use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::time::Duration;

use cluster_core::envelope::{Exit, Request};
use cluster_core::reply_handlers::UnregisterMode;
use cluster_core::storage::{MessageStorage, SaveRequestOptions};
use cluster_core::{Clock, ClusterError, EntityAddress, ShardId, ShardingConfig, Snowflake};
use tokio_util::task::TaskTracker;

use crate::api::entity::Ids;
use crate::placement::remote::Remote;
use crate::placement::shards::Shards;
use crate::runtime::delivery::ReadLatch;
use crate::runtime::manager::Residency;
use crate::runtime::registry::Managers;

mod direct;
mod lifecycle;
mod pushed;
mod read;
mod runs;
mod send;
mod tracked;
mod waiters;
mod writes;

pub(crate) use send::PersistedStream;

use direct::{DirectDelivery, DirectOrder};
use pushed::PushedDelivery;
use read::ReadLoop;
use runs::Runs;
use send::Sending;
use tracked::TrackedRequests;
use waiters::ReplyWaiters;
use writes::ShardWrites;

/// How many pushed requests this runner takes up at once (`pushed`): each is a task that reads
/// the request back from storage and hands it to its entity.
/// Past it, the read loop delivers them, woken at once: one read takes up a batch.
const TAKE_UPS_MAX: usize = 256;

/// Persisted delivery: the wiring of the processes that save, read, deliver and answer
/// persisted requests, over the parts they share.
///
/// Each process takes only the parts it uses:
///
/// - [`Sending`] (`send`): the callers' side, and the reply poller;
/// - [`ReadLoop`] (`read`): the storage read loop;
/// - [`DirectDelivery`] (`direct`): requests saved by the runner that serves them;
/// - [`PushedDelivery`] (`pushed`): requests pushed to this runner by their callers;
/// - [`Runs`] (`runs`): the claim, the hand-over to the entity and the stored outcome, where
///   every path ends.
///
/// The parts that own state and their lock: [`TrackedRequests`], [`ShardWrites`],
/// [`ReplyWaiters`] and [`DirectOrder`].
pub(crate) struct PersistedDelivery {
    pub(crate) storage: Arc<dyn MessageStorage>,
    sending: Arc<Sending>,
    read: Arc<ReadLoop>,
    pushed: Arc<PushedDelivery>,
    /// Tells the owner of a pushed request's shard to serve this runner's pushes.
    remote: Arc<Remote>,
    tracked: Arc<TrackedRequests>,
    writes: Arc<ShardWrites>,
    waiters: Arc<ReplyWaiters>,
    read_latch: Arc<ReadLatch>,
    /// The runtime's tasks: the loops.
    tasks: TaskTracker,
}

/// What persisted delivery starts from.
pub(crate) struct PersistedParts {
    pub(crate) storage: Arc<dyn MessageStorage>,
    /// The shards the read loop reads when no lock says otherwise (every shard of the groups
    /// of a runner on a storage of its own; none otherwise).
    pub(crate) shards: Vec<ShardId>,
    pub(crate) config: ShardingConfig,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) ids: Arc<Ids>,
    pub(crate) serving: Arc<Shards>,
    pub(crate) remote: Arc<Remote>,
    pub(crate) managers: Arc<Managers>,
    pub(crate) residency: Arc<Residency>,
    pub(crate) read_latch: Arc<ReadLatch>,
    pub(crate) tasks: TaskTracker,
}

impl PersistedDelivery {
    /// Persisted delivery from `parts`; its loops start with [`PersistedDelivery::start`].
    pub(crate) fn new(parts: PersistedParts) -> PersistedDelivery {
        let PersistedParts {
            storage,
            shards,
            config,
            clock,
            ids,
            serving,
            remote,
            managers,
            residency,
            read_latch,
            tasks,
        } = parts;
        let tracked = Arc::<TrackedRequests>::default();
        let writes = Arc::<ShardWrites>::default();
        let waiters = Arc::<ReplyWaiters>::default();
        let order = Arc::<DirectOrder>::default();
        let runs = Arc::new(Runs {
            storage: Arc::clone(&storage),
            serving: Arc::clone(&serving),
            managers: Arc::clone(&managers),
            tracked: Arc::clone(&tracked),
            writes: Arc::clone(&writes),
            waiters: Arc::clone(&waiters),
            read_latch: Arc::clone(&read_latch),
            ids: Arc::clone(&ids),
            clock: Arc::clone(&clock),
            tasks: tasks.clone(),
            registration_timeout: config.entity_registration_timeout,
            retry_interval: config.send_retry_interval,
        });
        let direct = Arc::new(DirectDelivery {
            runs: Arc::clone(&runs),
            order: Arc::clone(&order),
            storage: Arc::clone(&storage),
            serving: Arc::clone(&serving),
            tracked: Arc::clone(&tracked),
            managers: Arc::clone(&managers),
            read_latch: Arc::clone(&read_latch),
            clock: Arc::clone(&clock),
        });
        let read = Arc::new(ReadLoop {
            runs,
            storage: Arc::clone(&storage),
            serving: Arc::clone(&serving),
            shards,
            tracked: Arc::clone(&tracked),
            order,
            managers,
            residency,
            read_latch: Arc::clone(&read_latch),
            clock: Arc::clone(&clock),
            batch_size: config.unprocessed_message_batch_size,
            poll_interval: config.entity_message_poll_interval,
            retry_interval: config.send_retry_interval,
            last_read: AtomicI64::new(0),
        });
        let pushed = Arc::new(PushedDelivery {
            direct: Arc::clone(&direct),
            storage: Arc::clone(&storage),
            serving: Arc::clone(&serving),
            tracked: Arc::clone(&tracked),
            waiters: Arc::clone(&waiters),
            read_latch: Arc::clone(&read_latch),
            clock,
            take_ups: Arc::new(tokio::sync::Semaphore::new(TAKE_UPS_MAX)),
            tasks: tasks.clone(),
        });
        let sending = Arc::new(Sending {
            storage: Arc::clone(&storage),
            direct,
            waiters: Arc::clone(&waiters),
            remote: Arc::clone(&remote),
            serving,
            ids,
            tasks: tasks.clone(),
            reply_poll_interval: config.entity_reply_poll_interval,
        });
        PersistedDelivery {
            storage,
            sending,
            read,
            pushed,
            remote,
            tracked,
            writes,
            waiters,
            read_latch,
            tasks,
        }
    }

    /// Starts the reply poller and, for a runner, the storage read loop, on the runtime's
    /// tasks.
    ///
    /// A runner also serves the persisted requests its callers push to it (`pushed`).
    pub(crate) fn start(&self, runner: bool) {
        self.tasks.spawn(Arc::clone(&self.sending).poll_replies());
        if runner {
            self.tasks.spawn(Arc::clone(&self.read).run());
            self.tasks.spawn(Arc::clone(&self.read).report_read_lag());
            let pushed: std::sync::Weak<dyn crate::placement::remote::PushedRequests> =
                Arc::downgrade(&self.pushed) as _;
            self.remote.serve_pushed_with(pushed);
        }
    }

    /// Saves a persisted request and waits for its final reply's exit
    /// ([`Sending::send_persisted`]).
    pub(crate) async fn send_persisted(
        &self,
        request: Request,
        options: SaveRequestOptions,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        self.sending.send_persisted(request, options, uninterruptible).await
    }

    /// Saves a persisted streaming request ([`Sending::stream_persisted`]).
    pub(crate) async fn stream_persisted(
        &self,
        request: Request,
        options: SaveRequestOptions,
    ) -> Result<PersistedStream, ClusterError> {
        self.sending.stream_persisted(request, options).await
    }

    /// Saves a persisted request without waiting for its reply
    /// ([`Sending::notify_persisted`]).
    pub(crate) async fn notify_persisted(
        &self,
        request: Request,
        options: SaveRequestOptions,
    ) -> Result<(), ClusterError> {
        self.sending.notify_persisted(request, options).await
    }

    /// Stores an interrupt for the persisted request `request_id` of the entity at `address`,
    /// and wakes the owner's storage reader (see `Sharding::interrupt_request`).
    pub(crate) async fn interrupt_request(
        &self,
        address: &EntityAddress,
        request_id: Snowflake,
    ) -> Result<(), ClusterError> {
        self.sending.interrupt_request(address, request_id).await
    }

    /// Waits, at most `bound`, until no request of `shard` (of any shard, with `None`) is
    /// taken up and unsettled ([`ShardWrites::finished`]).
    pub(crate) async fn writes_finished(&self, shard: Option<&ShardId>, bound: Duration) {
        self.writes.finished(shard, bound).await;
    }

    /// Ends every local wait for a reply.
    ///
    /// This process shuts down and will not read replies any more.
    /// The callers fail with `ClusterError::Abandoned`; their requests stay stored.
    pub(crate) fn abandon_waiters(&self) {
        self.waiters.abandon(|_| true);
    }

    /// Shutdown began.
    /// The local callers of requests that no handler started hear at once that their requests
    /// are left stored for the next owner.
    pub(crate) fn abandon_undelivered(&self) {
        self.waiters.abandon(|request_id| !self.tracked.has_started(request_id));
    }

    /// Ends the local waits for replies of `shard`'s requests (the shard was released).
    pub(crate) fn unregister_shard(&self, shard: &ShardId, mode: UnregisterMode) {
        self.waiters.unregister_shard(shard, mode);
    }

    /// What wakes the storage read loop, for the components that change what it reads.
    pub(crate) fn read_latch(&self) -> &Arc<ReadLatch> {
        &self.read_latch
    }

    /// Wakes the storage read loop.
    pub(crate) fn poll_storage(&self) {
        self.read_latch.wake();
    }
}

/// The error of a persisted request in a runtime without a message storage.
pub(crate) fn not_stored(address: &EntityAddress) -> ClusterError {
    ClusterError::EntityNotAssignedToRunner { address: address.clone() }
}
