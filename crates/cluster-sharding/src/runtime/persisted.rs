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
//!   settled ([`WriteGuard`]), for a bounded time.
//!   So a request that finishes while its shard drains is answered here.
//! - **Fenced retries.** A handler's final reply whose write failed is retried only after the
//!   lock is confirmed again.
//!
//! A handler can still run more than once for one request.
//! That happens when its runner dies before the reply is stored, or when its reply is fenced.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{Envelope, Exit, Interrupt, Reply, Request, WithExit};
use cluster_core::future::BoxFuture;
use cluster_core::reply_handlers::UnregisterMode;
use cluster_core::storage::{
    MessageStorage, SaveRequestOptions, SaveResult, UnprocessedMessage, UnprocessedOptions,
};
use cluster_core::{
    Clock, ClusterError, EntityAddress, EntityType, ShardId, ShardingConfig, Snowflake,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::api::entity::Ids;
use crate::api::entity::malformed;
use crate::placement::remote::Remote;
use crate::placement::shards::Shards;
use crate::runtime::delivery::{
    Delivery, PendingTransaction, ReadLatch, Refused, ReplyTo, StreamReplies,
};
use crate::runtime::interrupt::InterruptSignal;
use crate::runtime::local::STREAM_BUFFER;
use crate::runtime::manager::Residency;
use crate::runtime::registry::Managers;

mod direct;
mod lifecycle;
mod pushed;
mod tracked;
mod waiters;
mod writes;

use direct::DirectOrder;
use lifecycle::{Busy, Claiming};
use tracked::{InFlight, TrackedRequests};
use waiters::{Answer, OwnedRegistration, ReplyWaiters, Waiter};
use writes::{ShardWrites, WriteGuard};

/// How often saving a final reply is tried before the request is left for a later read.
const SAVE_REPLY_ATTEMPTS: u32 = 4;
/// The pause between those attempts (the reference's 200 ms).
const SAVE_REPLY_SPACING: Duration = Duration::from_millis(200);
/// How often the read-loop lag gauge is set.
const READ_LAG_REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// How many pushed requests this runner takes up at once (`pushed`): each is a task that reads
/// the request back from storage and hands it to its entity.
/// Past it, the read loop delivers them, woken at once: one read takes up a batch.
const TAKE_UPS_MAX: usize = 256;
/// How often a request is saved again with a fresh id while its id is taken by another
/// message (see [`PersistedDelivery::id_taken`]).
const ID_ATTEMPTS_MAX: u32 = 8;

/// Persisted delivery: what a runtime with a message storage saves, reads, delivers and
/// answers. It works with the parts of the runtime it is given ([`PersistedParts`]).
pub(crate) struct PersistedDelivery {
    pub(crate) storage: Arc<dyn MessageStorage>,
    /// The settings it reads: poll intervals, the batch size, the registration timeout.
    config: ShardingConfig,
    clock: Arc<dyn Clock>,
    ids: Arc<Ids>,
    /// The shards this runtime serves: delivery, fencing and shutdown.
    serving: Arc<Shards>,
    /// Tells a stored message's owner to read it.
    remote: Arc<Remote>,
    managers: Arc<Managers>,
    residency: Arc<Residency>,
    /// The runtime's tasks: the outcome writers, the interrupt writers, the loops.
    tasks: TaskTracker,
    /// The shards this runner reads (every shard of its groups: one runner owns them all).
    shards: Vec<ShardId>,
    /// The local callers waiting for replies (`waiters`).
    waiters: Arc<ReplyWaiters>,
    /// Wakes the storage read loop (a new request, an interrupt, a registration).
    read_latch: Arc<ReadLatch>,
    /// The requests taken up here, from their claim to their stored outcome (`tracked`).
    tracked: Arc<TrackedRequests>,
    /// The requests taken up and not settled, counted per shard (`writes`).
    writes: Arc<ShardWrites>,
    /// Direct delivery's state (`direct`).
    direct: DirectOrder,
    /// The take-ups of pushed requests under way ([`TAKE_UPS_MAX`], `pushed`).
    take_ups: Arc<tokio::sync::Semaphore>,
    /// When the storage read loop last finished a read (the clock's epoch milliseconds, 0
    /// before the first): the read-loop lag metric's source.
    last_read: std::sync::atomic::AtomicI64,
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
        PersistedDelivery {
            storage,
            config,
            clock,
            ids,
            serving,
            remote,
            managers,
            residency,
            tasks,
            shards,
            waiters: Arc::default(),
            read_latch,
            tracked: Arc::default(),
            writes: Arc::default(),
            direct: DirectOrder::default(),
            take_ups: Arc::new(tokio::sync::Semaphore::new(TAKE_UPS_MAX)),
            last_read: std::sync::atomic::AtomicI64::new(0),
        }
    }

    /// Starts the reply poller and, for a runner, the storage read loop, on the runtime's
    /// tasks.
    ///
    /// A runner also serves the persisted requests its callers push to it (`pushed`).
    pub(crate) fn start(self: &Arc<PersistedDelivery>, runner: bool) {
        self.tasks.spawn(Arc::clone(self).poll_replies());
        if runner {
            self.tasks.spawn(Arc::clone(self).read_storage());
            self.tasks.spawn(Arc::clone(self).report_read_lag());
            let pushed: std::sync::Weak<dyn crate::placement::remote::PushedRequests> =
                Arc::downgrade(self) as _;
            self.remote.serve_pushed_with(pushed);
        }
    }

    fn config(&self) -> &ShardingConfig {
        &self.config
    }

    fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    fn next_id(&self) -> Snowflake {
        self.ids.next()
    }

    fn managers(&self) -> &Managers {
        &self.managers
    }

    fn residency(&self) -> &Residency {
        &self.residency
    }

    fn serves(&self, shard: &ShardId) -> bool {
        self.serving.serves(shard)
    }

    /// Whether a request of `shard` may be handed to an entity here now: served, within the
    /// lease of its last lock confirmation ([`Shards::delivers`]).
    fn delivers(&self, shard: &ShardId) -> bool {
        self.serving.delivers(shard)
    }

    async fn confirm_shard_lock(&self, shard: &ShardId) -> bool {
        self.serving.confirm(shard).await
    }

    fn is_shutdown(&self) -> bool {
        self.serving.shutdown().is_cancelled()
    }

    fn shutdown_token(&self) -> &tokio_util::sync::CancellationToken {
        self.serving.shutdown().token()
    }

    fn spawn_owned(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    fn wake_reader(&self, shard: &ShardId, envelope: impl FnOnce() -> Envelope) {
        self.remote.wake_reader(shard, envelope);
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

    /// Hands an interrupt or acknowledgement to the request it belongs to, if that request
    /// runs here.
    fn forward(&self, envelope: &Envelope) {
        match envelope {
            Envelope::Interrupt(interrupt) => self.tracked.interrupt(interrupt.request_id),
            Envelope::AckChunk(ack) => self.tracked.acknowledge(ack.request_id, ack.reply_id),
            Envelope::Request(_) => {}
        }
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

/// A persisted stream as its caller sees it: the replies channel, the registration that feeds
/// it, and the acknowledgements that go to storage.
pub(crate) struct PersistedStream {
    persisted: Arc<PersistedDelivery>,
    address: EntityAddress,
    request_id: Snowflake,
    pub(crate) replies: mpsc::Receiver<Reply>,
    /// Feeds `replies` while the stream lives.
    _registration: OwnedRegistration,
    /// Stops the task that reads the replies the owner pushes, when the stream goes.
    _pump: Option<tokio_util::sync::DropGuard>,
    interrupt: InterruptOnDrop,
}

impl PersistedStream {
    /// Stores the acknowledgement of chunk `reply_id`, which lets the handler send the next.
    pub(crate) async fn ack(&self, reply_id: Snowflake) -> Result<(), ClusterError> {
        let persisted = &self.persisted;
        let ack = cluster_core::envelope::AckChunk {
            id: self.persisted.next_id(),
            address: self.address.clone(),
            request_id: self.request_id,
            reply_id,
        };
        persisted.storage.save_ack_chunk(&ack).await?;
        if self.persisted.is_shutdown() {
            // Stored for the next owner, which resumes the stream after this chunk.
            // This consumer gets no further chunk here.
            // This is the reference's abandoned AckChunk (`effect/src/cluster/Sharding.ts`).
            return Err(ClusterError::EntityNotAssignedToRunner { address: self.address.clone() });
        }
        self.persisted.wake_reader(&self.address.shard_id, || Envelope::AckChunk(ack));
        Ok(())
    }

    /// Why the replies stopped before the final reply.
    ///
    /// - [`ClusterError::Abandoned`]: this runner stopped and left the request stored for the
    ///   next owner.
    /// - `None`: an interruption.
    pub(crate) fn ended_early(&self) -> Option<ClusterError> {
        self.persisted.is_shutdown().then(|| ClusterError::Abandoned {
            address: self.address.clone(),
            request_id: self.request_id,
        })
    }

    /// The stream ended: nothing to interrupt any more.
    pub(crate) fn finish(&mut self) {
        self.interrupt.persisted = None;
    }
}

/// Sends an interrupt for a persisted request whose caller went away, unless disarmed.
struct InterruptOnDrop {
    persisted: Option<Arc<PersistedDelivery>>,
    address: EntityAddress,
    request_id: Snowflake,
}

impl Drop for InterruptOnDrop {
    fn drop(&mut self) {
        let Some(persisted) = self.persisted.take() else { return };
        if persisted.is_shutdown() {
            // The request stays stored for the next run.
            // An interrupt saved now would cut it off there.
            // (effect's `Sharding.test.ts`: no interrupts for durable messages at shutdown.)
            return;
        }
        let interrupt = Interrupt {
            id: persisted.next_id(),
            address: self.address.clone(),
            request_id: self.request_id,
        };
        let owner = Arc::clone(&persisted);
        owner.spawn_owned(async move {
            let request_id = interrupt.request_id;
            if let Err(error) = persisted.store_interrupt(interrupt).await {
                tracing::warn!(%error, %request_id, "could not store an interrupt");
            }
        });
    }
}

impl PersistedDelivery {
    /// Stores an interrupt for the persisted request `request_id` of the entity at `address`,
    /// and wakes the owner's storage reader (see `Sharding::interrupt_request`).
    pub(crate) async fn interrupt_request(
        self: &Arc<Self>,
        address: &EntityAddress,
        request_id: Snowflake,
    ) -> Result<(), ClusterError> {
        let interrupt = Interrupt { id: self.next_id(), address: address.clone(), request_id };
        self.store_interrupt(interrupt).await
    }

    async fn store_interrupt(self: &Arc<Self>, interrupt: Interrupt) -> Result<(), ClusterError> {
        self.storage.save_interrupt(&interrupt).await?;
        let shard = interrupt.address.shard_id.clone();
        self.wake_reader(&shard, || Envelope::Interrupt(interrupt));
        Ok(())
    }
}

impl PersistedDelivery {
    /// Saves a persisted request and waits for its final reply's exit.
    ///
    /// Dropping the returned future stores an interrupt for the request, unless
    /// `uninterruptible` or the request was stored before (a duplicate of its primary key: its
    /// first caller may still wait for it).
    /// The request itself stays stored.
    pub(crate) async fn send_persisted(
        self: &Arc<Self>,
        mut request: Request,
        options: SaveRequestOptions,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        let mut attempt = 1;
        let (mut registration, mut replied, direct, saved, earlier) = loop {
            let (reply, replied) = oneshot::channel();
            // Registered before the save, so a reply saved right after it is not missed.
            let registration =
                self.waiters.register_exit(request.request_id, &request.address.shard_id, reply);
            let direct = self.plan_direct(&request, &options);
            let (saved, earlier) = self.save(&request, &options, direct.is_some()).await;
            if !matches!(saved, Ok(SaveResult::Success)) {
                self.direct.unhold(&request.address, request.request_id);
            }
            if !self.id_taken(&saved, &mut request, &mut attempt) {
                break (registration, replied, direct, saved, earlier);
            }
        };
        let waited_id = match saved? {
            SaveResult::Success => request.request_id,
            SaveResult::Duplicate {
                last_received_reply: Some(Reply::WithExit(with_exit)), ..
            } => {
                return Ok(with_exit.exit);
            }
            SaveResult::Duplicate { original_id, .. } => {
                let (reply, duplicate_replied) = oneshot::channel();
                registration =
                    self.waiters.register_exit(original_id, &request.address.shard_id, reply);
                replied = duplicate_replied;
                original_id
            }
        };
        let fresh = waited_id == request.request_id;
        // A duplicate is pushed under the stored request's id: the owner runs (or waits for)
        // the stored request, not this copy.
        let waited = match fresh {
            true => request.clone(),
            false => Request { request_id: waited_id, ..request.clone() },
        };
        let mut push = None;
        if let Some(reservation) = direct.filter(|_| fresh) {
            // Boxed: its future would otherwise be inside this one, which the caller moves at
            // each await.
            Box::pin(self.deliver_directly(request.clone(), reservation, earlier)).await;
        } else if let Some(pushed) = self.remote.push(&waited) {
            // The owner runs it at once and answers on the call (`pushed`).
            push = Some(pushed);
        } else {
            self.wake_reader(&request.address.shard_id, || Envelope::Request(request.clone()));
        }
        if self.is_shutdown() {
            // Sent while this runner stops (an entity's `on_stop`): no reply will be read here.
            // The request is stored for the next owner.
            // This is the reference's abandon path (`effect/src/cluster/Sharding.ts`).
            tracing::debug!(request_id = %waited_id, "persisted request sent during shutdown: left stored");
            return Err(ClusterError::Abandoned {
                address: request.address,
                request_id: waited_id,
            });
        }
        // Only the caller that stored the request interrupts it when it goes away.
        // A duplicate's caller waits for a request that another caller made, and may still be
        // waiting for (the reference's client interrupts the request id it made, which a
        // duplicate never stored: `effect/src/cluster/Sharding.ts`, the client's `Interrupt`).
        let mut interrupt = InterruptOnDrop {
            persisted: (!uninterruptible && fresh).then(|| Arc::clone(self)),
            address: request.address.clone(),
            request_id: waited_id,
        };
        // A shard that moves or a fenced reply keeps the wait going.
        // The reply poller reads the next owner's reply.
        // Only shutdown ends the wait without a reply.
        let exit = match push {
            Some(push) => self.await_pushed(&waited, push, &mut replied).await,
            None => self.await_reply(&request.address, waited_id, &mut replied).await,
        };
        interrupt.persisted = None;
        drop(registration);
        exit
    }

    /// Saves a persisted streaming request; its chunks and final reply arrive on the returned
    /// stream's channel.
    pub(crate) async fn stream_persisted(
        self: &Arc<Self>,
        request: Request,
        options: SaveRequestOptions,
    ) -> Result<PersistedStream, ClusterError> {
        let (sender, replies) = mpsc::channel(STREAM_BUFFER);
        let shard_id = &request.address.shard_id.clone();
        let (mut request, mut attempt) = (request, 1);
        let (mut registration, saved) = loop {
            let registration =
                self.waiters.register(request.request_id, shard_id, Waiter::stream(sender.clone()));
            let saved = self.storage.save_request(&request, &options).await.map_err(Into::into);
            if !self.id_taken(&saved, &mut request, &mut attempt) {
                break (registration, saved);
            }
        };
        let request_id = match saved? {
            SaveResult::Success => request.request_id,
            SaveResult::Duplicate { original_id, last_received_reply } => {
                registration =
                    self.waiters.register(original_id, shard_id, Waiter::stream(sender.clone()));
                if let Some(reply) = last_received_reply {
                    let _ = sender.try_send(reply);
                }
                original_id
            }
        };
        let fresh = request_id == request.request_id;
        // The stored request is what the owner runs, under its own id.
        let waited = Request { request_id, ..request.clone() };
        let pump = match self.remote.push_stream(&waited) {
            Some(call) => Some(self.pump_pushed(waited, call)),
            None => {
                self.wake_reader(&request.address.shard_id, || Envelope::Request(waited));
                None
            }
        };
        // As for a unary request: a duplicate's reader does not interrupt another's stream.
        let interrupt = InterruptOnDrop {
            persisted: fresh.then(|| Arc::clone(self)),
            address: request.address.clone(),
            request_id,
        };
        Ok(PersistedStream {
            persisted: Arc::clone(self),
            address: request.address,
            request_id,
            replies,
            _registration: registration,
            _pump: pump,
            interrupt,
        })
    }

    /// Saves a persisted request without waiting for its reply (a discarded call).
    pub(crate) async fn notify_persisted(
        self: &Arc<Self>,
        mut request: Request,
        options: SaveRequestOptions,
    ) -> Result<(), ClusterError> {
        let mut attempt = 1;
        let (direct, saved, earlier) = loop {
            let direct = self.plan_direct(&request, &options);
            let (saved, earlier) = self.save(&request, &options, direct.is_some()).await;
            if !matches!(saved, Ok(SaveResult::Success)) {
                self.direct.unhold(&request.address, request.request_id);
            }
            if !self.id_taken(&saved, &mut request, &mut attempt) {
                break (direct, saved, earlier);
            }
        };
        // The save's error first: a request that was not stored must not look sent.
        let saved = saved?;
        if let Some(reservation) = direct.filter(|_| matches!(saved, SaveResult::Success)) {
            Box::pin(self.deliver_directly(request, reservation, earlier)).await;
        } else {
            self.wake_reader(&request.address.shard_id, || Envelope::Request(request.clone()));
        }
        Ok(())
    }

    /// Whether `request`'s save found its id taken by another message (`Conflict`: a primary
    /// key's duplicate is not an error but `SaveResult::Duplicate`), with attempts left; if so,
    /// `request` gets a fresh id to be saved again.
    ///
    /// Two processes make the same snowflake when they share a machine id and its millisecond
    /// and sequence: a client-only process draws its machine id at random, and a runner may
    /// get the same one from the registry (the reference's generator has the same gap).
    fn id_taken(
        &self,
        saved: &Result<SaveResult, ClusterError>,
        request: &mut Request,
        attempt: &mut u32,
    ) -> bool {
        let taken = matches!(
            saved,
            Err(ClusterError::Persistence(error))
                if error.kind() == cluster_core::error::StorageErrorKind::Conflict
        );
        if !taken || *attempt >= ID_ATTEMPTS_MAX {
            return false;
        }
        *attempt += 1;
        let fresh = self.next_id();
        tracing::warn!(taken = %request.request_id, %fresh, "a persisted request's id is taken by another message (a process shares this machine id): saving it with a fresh id");
        request.request_id = fresh;
        true
    }

    /// Waits for the final reply of `request`, pushed to its owner as `push`.
    ///
    /// The first of the owner's answer on the call and the stored reply (read by the reply
    /// poller) wins.
    /// Both are the stored final reply (see `pushed`).
    /// A failed call leaves the wait to storage, and the owner is told to read.
    async fn await_pushed(
        self: &Arc<Self>,
        request: &Request,
        push: BoxFuture<'static, Result<Reply, ClusterError>>,
        replied: &mut oneshot::Receiver<Answer>,
    ) -> Result<Exit, ClusterError> {
        let (address, request_id) = (&request.address, request.request_id);
        let waiting = crate::metrics::Occupied::of(crate::metrics::PERSISTED_PUSHED_WAITING);
        tokio::select! {
            pushed = push => match pushed {
                Ok(Reply::WithExit(with_exit)) => {
                    metrics::counter!(crate::metrics::PERSISTED_PUSHED, "answer" => "pushed")
                        .increment(1);
                    return Ok(with_exit.exit);
                }
                Ok(Reply::Chunk(_)) => {
                    tracing::debug!(%request_id, "a pushed request was answered with a chunk; waiting on storage");
                }
                // Also when the transport's lane of pushes to the owner is full: the request
                // is stored, and the owner is told to read it.
                Err(error) => {
                    tracing::debug!(%error, %request_id, "pushing the request failed; waiting on storage");
                    self.wake_reader(&address.shard_id, || Envelope::Request(request.clone()));
                }
            },
            answer = &mut *replied => {
                metrics::counter!(crate::metrics::PERSISTED_PUSHED, "answer" => "stored")
                    .increment(1);
                return Self::answered(address, request_id, answer);
            }
        }
        drop(waiting);
        metrics::counter!(crate::metrics::PERSISTED_PUSHED, "answer" => "fallback").increment(1);
        self.await_reply(address, request_id, replied).await
    }

    async fn await_reply(
        self: &Arc<Self>,
        address: &EntityAddress,
        request_id: Snowflake,
        replied: &mut oneshot::Receiver<Answer>,
    ) -> Result<Exit, ClusterError> {
        // Woken by a reply saved in this process, or by the reply poller.
        Self::answered(address, request_id, replied.await)
    }

    /// What a local caller of `request_id` returns, from what its waiter heard.
    fn answered(
        address: &EntityAddress,
        request_id: Snowflake,
        answer: Result<Answer, oneshot::error::RecvError>,
    ) -> Result<Exit, ClusterError> {
        match answer {
            Ok(Ok(Reply::WithExit(with_exit))) => Ok(with_exit.exit),
            // This process stops: the request stays stored for the next owner.
            Ok(Err(UnregisterMode::Abandon)) => {
                Err(ClusterError::Abandoned { address: address.clone(), request_id })
            }
            // Unregistered without a reply otherwise: the reply will not be read here.
            _ => Err(ClusterError::EntityNotAssignedToRunner { address: address.clone() }),
        }
    }

    /// Reads the final replies of the requests that local callers wait for
    /// (`effect/src/cluster/Runners.ts`).
    ///
    /// It reads them all in one query, every `entity_reply_poll_interval` while anyone waits.
    /// It finds the replies that another process saved, or that this process saved before a
    /// restart.
    pub(crate) async fn poll_replies(self: Arc<Self>) {
        let interval = self.config().entity_reply_poll_interval;
        loop {
            tokio::select! {
                () = self.waiters.someone_waits() => {}
                () = self.shutdown_token().cancelled() => return,
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.shutdown_token().cancelled() => return,
            }
            // Who waits is read now, not before the sleep: a caller that started waiting
            // meanwhile is read at this poll rather than the next.
            let waiting = self.waiters.waiting();
            if waiting.is_empty() {
                continue;
            }
            match self.storage.replies_for(&waiting).await {
                Ok(replies) => {
                    // Final replies and unacknowledged chunks: stream readers skip the chunks
                    // they already have.
                    self.waiters.on_replies_saved(&replies);
                }
                Err(error) => tracing::debug!(%error, "could not poll replies"),
            }
        }
    }

    /// The storage read loop; runs until shutdown.
    pub(crate) async fn read_storage(self: Arc<Self>) {
        let config = self.config().clone();
        let mut state = ReadState::default();
        loop {
            // When the next read comes:
            // - after `send_retry_interval`, for a full mailbox;
            // - when an entity is reaped, for requests held back by the residency cap;
            // - at the next poll, for everything else.
            let wait = if state.retry_soon {
                config.send_retry_interval
            } else {
                config.entity_message_poll_interval
            };
            let residency = self.residency();
            tokio::select! {
                () = self.read_latch.woken() => {}
                () = tokio::time::sleep(wait) => {}
                () = residency.freed(), if state.capped => {}
                () = self.shutdown_token().cancelled() => return,
            }
            state.retry_soon = false;
            state.capped = false;
            // Drain a backlog at once, but never spin on a full batch of skipped messages.
            loop {
                let read = self.read_once(&mut state).await;
                if read.is_some() {
                    let now = self.clock().now().unix_millis();
                    self.last_read.store(now, std::sync::atomic::Ordering::Relaxed);
                }
                if !matches!(read, Some(Read { full: true, delivered: true })) {
                    break;
                }
            }
        }
    }

    /// Sets the read-loop lag gauge every second: the time since the read loop last finished
    /// a read.
    /// It grows while the loop is stuck (a storage call that hangs, a read that waits), the
    /// "healthy but not consuming" runner.
    async fn report_read_lag(self: Arc<Self>) {
        let mut ticks = tokio::time::interval(READ_LAG_REPORT_INTERVAL);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = self.shutdown_token().cancelled() => return,
            }
            let last = self.last_read.load(std::sync::atomic::Ordering::Relaxed);
            let lag = match last {
                0 => Duration::ZERO,
                last => {
                    let millis = self.clock().now().unix_millis().saturating_sub(last);
                    Duration::from_millis(u64::try_from(millis).unwrap_or(0))
                }
            };
            ::metrics::gauge!(crate::metrics::READ_LOOP_LAG).set(lag.as_secs_f64());
        }
    }

    /// The entities whose messages alone the next read takes, at the residency cap once a
    /// newcomer was refused there; `None` for every message.
    fn residents_to_read(&self, state: &mut ReadState) -> Option<Vec<EntityAddress>> {
        let at_cap = self.residency().is_full();
        state.residents_only &= at_cap;
        state.capped |= at_cap;
        state.residents_only.then(|| self.managers().resident_addresses())
    }

    /// One read of the storage read loop (`effect/src/cluster/Sharding.ts`).
    ///
    /// - At the residency cap, once a newcomer was refused (no resident instance was idle to
    ///   passivate for it), only the resident entities' messages are read, so that they keep
    ///   progressing.
    /// - Otherwise, every message of this runner's shards is read; at the cap, newcomers make
    ///   room by passivating idle instances.
    /// - `None` means that the read failed.
    async fn read_once(self: &Arc<Self>, state: &mut ReadState) -> Option<Read> {
        let batch_size = self.config().unprocessed_message_batch_size;
        let residents = self.residents_to_read(state);
        let addresses = residents.as_deref();
        let whole_shards = addresses.is_none();
        let options = UnprocessedOptions { limit: Some(batch_size), addresses };
        let now = self.clock().now();
        // A single runner reads every shard of its groups, unless it lost some of their locks.
        // A cluster's read holds its guard until its claim is stored: a shard's release waits
        // for it before the lock goes.
        let (held, reading) = match self.serving.member() {
            Some(cluster) => {
                let (readable, reading) = cluster.begin_read().await;
                (Some(readable), Some(reading))
            }
            None => (self.serving.held_locks().and_then(|locks| locks.served()), None),
        };
        let shards = match &held {
            Some(held) if held.is_empty() => return Some(Read { full: false, delivered: false }),
            Some(held) => held.as_slice(),
            None => &self.shards,
        };
        self.tracked.begin_read();
        let claimed = self.storage.unprocessed_messages(shards, now, options).await;
        drop(reading);
        let batch = match claimed {
            Ok(batch) => batch,
            Err(error) => {
                self.tracked.end_read();
                tracing::warn!(%error, "could not read unprocessed messages");
                return None;
            }
        };
        let full = batch.len() >= usize::try_from(batch_size.get()).unwrap_or(usize::MAX);
        for malformed_row in &batch.malformed {
            let reply = self
                .final_reply(malformed_row.request_id, malformed(&malformed_row.error.to_string()));
            self.save_final_reply(reply, None).await;
        }
        let mut delivered = false;
        let mut release = Vec::new();
        let mut refused = BTreeSet::new();
        for message in batch.messages {
            let request = match &message.envelope {
                Envelope::Request(request) => Some((request.address.clone(), request.request_id)),
                _ => None,
            };
            if let Some((address, request_id)) = &request
                && refused.contains(address)
            {
                // An earlier request to this entity was not delivered: this one waits behind
                // it, so that the entity sees them in order.
                self.direct.hold(address, *request_id);
                release.push(*request_id);
                continue;
            }
            let dispatched = self.dispatch(message, &mut state.unregistered, Claiming::Read);
            if let Some((address, request_id)) = &request {
                match dispatched {
                    Dispatched::Delivered
                    | Dispatched::Skipped
                    | Dispatched::Settled(_)
                    | Dispatched::Answer(_) => {
                        self.direct.unhold(address, *request_id);
                    }
                    _ => {
                        self.direct.hold(address, *request_id);
                        refused.insert(address.clone());
                    }
                }
            }
            match dispatched {
                Dispatched::Delivered => delivered = true,
                Dispatched::Skipped => {}
                // Answered (or being answered) since the select: this read's claim goes, in
                // case its outcome was to run again.
                Dispatched::Settled(id) | Dispatched::Release(id) => release.push(id),
                Dispatched::Retry(id) => {
                    state.retry_soon = true;
                    release.push(id);
                }
                Dispatched::Capped(id) => {
                    state.capped = true;
                    state.residents_only = true;
                    release.push(id);
                }
                Dispatched::Answer(reply) => self.save_final_reply(reply, None).await,
            }
        }
        self.tracked.end_read();
        // Held now: a cluster's shards may have moved during the read; a single runner's not.
        let held_now = self.serving.member().map(|cluster| cluster.readable());
        self.direct.caught_up(shards, held_now.as_deref().unwrap_or(shards), whole_shards && !full);
        state.unregistered.warn();
        if !release.is_empty()
            && let Err(error) = self.storage.reset_requests(&release).await
        {
            tracing::debug!(%error, "could not release claims");
        }
        Some(Read { full, delivered })
    }

    /// Takes up one stored message.
    ///
    /// - A request goes to its entity.
    ///   It is claimed first, so that it runs once however many paths find it.
    /// - An interrupt or an acknowledgement goes to the request it belongs to.
    ///
    /// Nothing here waits, so nothing can change between the checks that admit a request and
    /// its arrival in the mailbox.
    /// (A `WITH_TRANSACTION` request's transaction is begun by its instance, not here.)
    /// `claiming` says who dispatches (see [`Claiming`]).
    fn dispatch(
        self: &Arc<Self>,
        message: UnprocessedMessage,
        unregistered: &mut Unregistered,
        claiming: Claiming,
    ) -> Dispatched {
        let request = match message.envelope {
            Envelope::Request(request) => request,
            envelope => {
                self.forward(&envelope);
                return Dispatched::Skipped;
            }
        };
        let request_id = request.request_id;
        let shard = request.address.shard_id.clone();
        let Some(manager) = self.managers().get(&request.address.entity_type) else {
            if !self.serves(&shard) {
                return Dispatched::Release(request_id);
            }
            let timeout = self.config().entity_registration_timeout;
            return match unregistered.hold(&request.address.entity_type, timeout) {
                true => Dispatched::Release(request_id),
                false => {
                    let message =
                        format!("Entity type '{}' not registered", request.address.entity_type);
                    let defect = Exit::die_with_message("Error", &message);
                    Dispatched::Answer(self.final_reply(request_id, defect))
                }
            };
        };
        unregistered.registered(&request.address.entity_type);
        let cancellation = InterruptSignal::new();
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (acks, reply, outcome) = if manager.is_stream(&request.tag) {
            let last_sent = match message.last_sent_reply {
                Some(Reply::Chunk(chunk)) => Some(chunk),
                _ => None,
            };
            let (replies, replied) = mpsc::channel(STREAM_BUFFER);
            let (acked, acks) = mpsc::channel(STREAM_BUFFER);
            let reply = ReplyTo::Stream(StreamReplies { replies, acks, last_sent });
            (Some(acked), reply, Outcome::Stream(replied))
        } else {
            let (reply, exit) = oneshot::channel();
            (None, ReplyTo::Exit(reply), Outcome::Exit(exit))
        };
        let in_flight = InFlight::new(cancellation.clone(), Arc::clone(&started), acks);
        let claim = match self.tracked.claim(request_id, in_flight, claiming) {
            Ok(claim) => claim,
            // Already being processed (AlreadyProcessingMessage): its reply will complete it.
            Err(Busy::Running) => return Dispatched::Skipped,
            // Another dispatch is handing it to its entity: the read's later requests to that
            // entity wait for the next read, which comes soon, so that they do not go first.
            Err(Busy::Arriving) if claiming == Claiming::Read => {
                return Dispatched::Retry(request_id);
            }
            Err(Busy::Arriving) => return Dispatched::Skipped,
            Err(Busy::Settled) => return Dispatched::Settled(request_id),
        };
        // Before the shard's check.
        // So a release that stops serving the shard after the check waits for this request's
        // outcome before it lets the lock go.
        let write = self.writes.begin(&shard);
        if !self.delivers(&shard) {
            // The shard was let go since the read (its next owner runs the request), or its
            // lease lapsed (the next read after a refresh delivers it).
            return Dispatched::Release(request_id);
        }
        let transaction = manager
            .with_transaction(&request.tag, &request.payload)
            .then(|| PendingTransaction::new(Arc::clone(&self.storage)));
        let rerun = manager.rerun_on_interrupt(&request.tag).then(|| request.clone());
        let delivery = Delivery {
            request,
            cancellation,
            reply,
            transaction: transaction.clone(),
            started: Some(started),
        };
        match manager.deliver(Box::new(delivery), &*self.serving) {
            Ok(()) => {
                claim.keep();
                let sent = Sent { request_id, shard, outcome, transaction, rerun, write };
                self.spawn_owned(Arc::clone(self).store_outcome(sent));
                Dispatched::Delivered
            }
            Err(refused) => {
                tracing::debug!(?refused, %request_id, "not delivered; retried on a later read");
                match refused {
                    Refused::ResidencyFull(_) => Dispatched::Capped(request_id),
                    Refused::Cluster(ClusterError::MailboxFull { .. }) => {
                        Dispatched::Retry(request_id)
                    }
                    Refused::Cluster(_) => Dispatched::Release(request_id),
                }
            }
        }
    }

    /// Stores what a delivered request produced: its chunks (a stream) and its final reply.
    ///
    /// A request interrupted by shutdown, or whose entity went away, is left stored for the
    /// next run.
    fn store_outcome(self: Arc<Self>, sent: Sent) -> BoxFuture<'static, ()> {
        // Boxed: a re-run dispatches again, which spawns another `store_outcome`.
        Box::pin(async move {
            let Sent { request_id, shard, outcome, transaction, rerun, write } = sent;
            let exit = match outcome {
                Outcome::Exit(exit) => exit.await.ok(),
                Outcome::Stream(mut replies) => {
                    let mut exit = None;
                    while let Some(reply) = replies.recv().await {
                        match reply {
                            Reply::Chunk(_) => {
                                // A chunk the storage refuses is never stored, so never
                                // acknowledged: the stream ends here with a defect, and the
                                // handler's next send fails once `replies` is dropped.
                                if let Err(refused) = self.save_reply_retrying(&reply).await {
                                    let message = format!(
                                        "a chunk of the stream could not be stored: {refused}"
                                    );
                                    exit = Some(Exit::die_with_message("ReplyNotStored", &message));
                                    break;
                                }
                            }
                            Reply::WithExit(with_exit) => {
                                exit = Some(with_exit.exit);
                                break;
                            }
                        }
                    }
                    exit
                }
            };
            // The read loop must not take it up again while its outcome is stored.
            let _settle = self.tracked.settle(request_id);
            // Held from the claim to here: the shard's release waits for the outcome.
            let _write = write;
            let transaction = match transaction {
                Some(transaction) => transaction.take().await,
                None => None,
            };
            if let Some(transaction) = transaction {
                match exit {
                    Some(exit) if exit.is_success() => {
                        if !self.confirm_shard_lock(&shard).await {
                            let _ = transaction.rollback().await;
                            return self.fenced(request_id, &shard).await;
                        }
                        let reply = self.final_reply(request_id, exit);
                        self.commit_final_reply(transaction, reply, &shard).await;
                        return;
                    }
                    // A failure is saved after the rollback
                    // (`effect/src/cluster/SqlMessageStorage.ts`).
                    _ => {
                        if let Err(error) = transaction.rollback().await {
                            tracing::debug!(%error, %request_id, "rollback failed");
                        }
                    }
                }
            }
            match exit {
                // Interrupted because this runner stops serving the shard (shutdown, a
                // rebalance, lost locks).
                // It is left stored for the next owner.
                Some(Exit::Failure(cause))
                    if cause.has_interrupts_only() && !self.serves(&shard) =>
                {
                    let _ = self.storage.reset_requests(&[request_id]).await;
                }
                // Server-side uninterruptible: an interrupt runs it again instead of answering it.
                Some(Exit::Failure(cause)) if cause.has_interrupts_only() && rerun.is_some() => {
                    if let Some(request) = rerun {
                        self.rerun(request).await;
                    }
                }
                Some(_) if !self.confirm_shard_lock(&shard).await => {
                    self.fenced(request_id, &shard).await;
                }
                Some(exit) => {
                    let reply = self.final_reply(request_id, exit);
                    self.save_final_reply(reply, Some(&shard)).await;
                }
                None => {
                    let _ = self.storage.reset_requests(&[request_id]).await;
                }
            }
        })
    }

    /// The lock of `shard` was not confirmed (effect 4.1.0 fencing).
    ///
    /// - The final reply is not stored.
    /// - The claim is released for the shard's next owner.
    /// - The next owner may be this runner: only the confirmation may have failed (a storage
    ///   call that failed or timed out), the lock still held.
    ///   So the lock is confirmed once more, and if it is held the read loop is woken: its next
    ///   read runs the request again, rather than its next poll.
    ///   Otherwise nothing is woken: a runner whose lock storage fails would run the request
    ///   again and again, each run fenced.
    ///   A shard that moved is read by its new owner when it takes it.
    /// - Local callers keep waiting; they read the reply from storage once that owner stores it.
    async fn fenced(self: &Arc<Self>, request_id: Snowflake, shard: &ShardId) {
        if let Err(error) = self.storage.reset_requests(&[request_id]).await {
            tracing::debug!(%error, %request_id, "could not release a fenced request's claim");
        }
        if self.confirm_shard_lock(shard).await {
            tracing::debug!(%request_id, "fenced request released; its lock is held: reading storage again");
            self.poll_storage();
        }
    }

    /// Hands an interrupted server-side uninterruptible request to its entity again
    /// (`effect/src/cluster/internal/entityManager.ts`).
    ///
    /// It waits out a full mailbox or the residency cap.
    /// If the runner stops first, the request stays stored for the next run.
    async fn rerun(self: &Arc<Self>, request: Request) {
        let request_id = request.request_id;
        tracing::debug!(%request_id, "interrupted uninterruptible request runs again");
        loop {
            if self.is_shutdown() {
                let _ = self.storage.reset_requests(&[request_id]).await;
                return;
            }
            let message = UnprocessedMessage {
                envelope: Envelope::Request(request.clone()),
                last_sent_reply: None,
            };
            let mut unregistered = Unregistered::default();
            let dispatched = self.dispatch(message, &mut unregistered, Claiming::Rerun);
            unregistered.warn();
            match dispatched {
                Dispatched::Delivered | Dispatched::Skipped | Dispatched::Settled(_) => return,
                Dispatched::Answer(reply) => {
                    return self.save_final_reply(reply, None).await;
                }
                Dispatched::Release(_) => {
                    let _ = self.storage.reset_requests(&[request_id]).await;
                    self.poll_storage();
                    return;
                }
                Dispatched::Retry(_) | Dispatched::Capped(_) => {
                    tokio::time::sleep(self.config().send_retry_interval).await;
                }
            }
        }
    }

    /// Saves a successful request's final reply inside its transaction, and commits.
    ///
    /// - The local waiters hear of the reply only after the commit (effect 4.0.3).
    /// - If the commit's outcome is unknown, storage decides.
    ///   A stored final reply means that the commit happened; otherwise the request runs again.
    /// - A reply the storage refuses (a value over its limit) is never committed: the
    ///   transaction rolls back, and the request is answered with a `ReplyNotStored` defect,
    ///   as outside a transaction ([`save_final_reply`](Self::save_final_reply)).
    async fn commit_final_reply(
        self: &Arc<Self>,
        mut transaction: Box<dyn cluster_core::storage::MessageTransaction>,
        reply: Reply,
        shard: &ShardId,
    ) {
        let request_id = reply.request_id();
        let committed = match transaction.save_reply(&reply).await {
            Ok(()) => transaction.commit().await,
            Err(error) => {
                let _ = transaction.rollback().await;
                if error.kind() == cluster_core::error::StorageErrorKind::InvalidInput {
                    tracing::warn!(%error, %request_id, "a transactional reply cannot be stored: its writes are rolled back");
                    return self.save_final_reply(reply, Some(shard)).await;
                }
                Err(error)
            }
        };
        match committed {
            Ok(()) => {
                self.record_answered(&reply);
                self.waiters.on_reply_saved(&reply);
            }
            Err(error) => {
                tracing::warn!(%error, %request_id, "could not commit a reply");
                let stored = self.storage.replies_for(&[request_id]).await.unwrap_or_default();
                match stored.into_iter().find(Reply::is_final) {
                    Some(final_reply) => {
                        self.waiters.on_reply_saved(&final_reply);
                    }
                    None => {
                        let _ = self.storage.reset_requests(&[request_id]).await;
                        self.poll_storage();
                    }
                }
            }
        }
    }

    /// Records the time from a request's save (its id's timestamp) to its stored final reply.
    fn record_answered(&self, reply: &Reply) {
        let saved = reply.request_id().timestamp();
        let took = self.clock().now().saturating_duration_since(saved);
        ::metrics::histogram!(crate::metrics::PERSISTED_LATENCY).record(took.as_secs_f64());
    }

    /// Stores a chunk (retrying a few times) and hands it to local waiters.
    ///
    /// `Err` is a chunk the storage refuses for good (`InvalidInput`, over its size limit);
    /// other failures are logged once the retries are spent.
    async fn save_reply_retrying(
        self: &Arc<Self>,
        reply: &Reply,
    ) -> Result<(), cluster_core::StorageError> {
        for attempt in 1..=SAVE_REPLY_ATTEMPTS {
            match self.storage.save_reply(reply).await {
                Ok(()) => {
                    self.waiters.on_reply_saved(reply);
                    return Ok(());
                }
                // A conflict is not a passing failure: no retry stores the chunk.
                // Either an earlier attempt stored it and its acknowledgement was lost (a
                // storage that rejects the same chunk twice says so).
                // Or a chunk of another run holds its sequence.
                Err(error) if error.kind() == cluster_core::error::StorageErrorKind::Conflict => {
                    self.chunk_conflict(reply, &error).await;
                    return Ok(());
                }
                // The storage cannot hold this chunk (a value over its limit): no retry would.
                Err(error)
                    if error.kind() == cluster_core::error::StorageErrorKind::InvalidInput =>
                {
                    tracing::warn!(%error, request_id = %reply.request_id(), "a chunk cannot be stored; ending the stream with a defect");
                    return Err(error);
                }
                Err(error) if attempt < SAVE_REPLY_ATTEMPTS => {
                    tracing::debug!(%error, attempt, "could not save a chunk, retrying");
                    tokio::time::sleep(SAVE_REPLY_SPACING).await;
                }
                // The caller never sees this chunk and so never acknowledges it: the stream
                // stalls until the request is interrupted or the runner restarts.
                Err(error) => {
                    tracing::warn!(%error, request_id = %reply.request_id(), "could not save a chunk")
                }
            }
        }
        Ok(())
    }

    /// A chunk's save hit a stored reply.
    ///
    /// - If it is this chunk, an attempt whose acknowledgement was lost stored it.
    ///   The local waiters get it as if this save had succeeded.
    ///   (Otherwise only the reply poller would hand it over.)
    /// - Otherwise the conflict is logged.
    async fn chunk_conflict(self: &Arc<Self>, reply: &Reply, error: &cluster_core::StorageError) {
        let request_id = reply.request_id();
        match self.storage.replies_for_unfiltered(&[request_id]).await {
            Ok(stored) if stored.iter().any(|stored| stored.id() == reply.id()) => {
                tracing::debug!(%request_id, reply_id = %reply.id(), "chunk already stored");
                self.waiters.on_reply_saved(reply);
            }
            Ok(_) => {
                tracing::warn!(%error, %request_id, "a chunk conflicts with one of another run");
            }
            Err(read) => {
                tracing::warn!(%error, %read, %request_id, "a chunk conflicts; storage unreadable");
            }
        }
    }

    fn final_reply(self: &Arc<Self>, request_id: Snowflake, exit: Exit) -> Reply {
        Reply::WithExit(WithExit { request_id, id: self.next_id(), exit })
    }

    /// Stores a final reply, retrying a few times, and wakes the local waiters.
    ///
    /// `fence` is the shard whose lock was just confirmed for this reply, if any.
    /// With it, a failed write is retried only after the lock is confirmed again.
    /// So a retry never lands after this runner lost or let go of the shard.
    /// When the lock is not confirmed, the request is left for the next owner.
    async fn save_final_reply(self: &Arc<Self>, mut reply: Reply, fence: Option<&ShardId>) {
        let mut replaced = false;
        let mut attempt = 0;
        while attempt < SAVE_REPLY_ATTEMPTS {
            attempt += 1;
            if let Some(shard) = fence
                && attempt > 1
                && !self.confirm_shard_lock(shard).await
            {
                return self.fenced(reply.request_id(), shard).await;
            }
            match self.storage.save_reply(&reply).await {
                Ok(()) => {
                    self.record_answered(&reply);
                    self.waiters.on_reply_saved(&reply);
                    return;
                }
                Err(error) if error.kind() == cluster_core::error::StorageErrorKind::Conflict => {
                    tracing::debug!(%error, request_id = %reply.request_id(), "request already answered");
                    return;
                }
                // The storage cannot hold this reply: a value beyond a column, such as a reply
                // over 64 KiB in MySQL's TEXT.
                // No retry or rerun would store it.
                // So the request is answered with a defect that says why, instead of running
                // again forever.
                Err(error)
                    if error.kind() == cluster_core::error::StorageErrorKind::InvalidInput
                        && !replaced =>
                {
                    tracing::warn!(%error, request_id = %reply.request_id(), "the reply cannot be stored; answering with a defect");
                    let message = format!("the reply could not be stored: {error}");
                    reply = self.final_reply(
                        reply.request_id(),
                        Exit::die_with_message("ReplyNotStored", &message),
                    );
                    replaced = true;
                    // The defect's first write is not a retry of the refused one.
                    attempt -= 1;
                }
                Err(error) if attempt < SAVE_REPLY_ATTEMPTS => {
                    tracing::debug!(%error, attempt, "could not save a reply, retrying");
                    tokio::time::sleep(SAVE_REPLY_SPACING).await;
                }
                Err(error) => {
                    tracing::warn!(%error, request_id = %reply.request_id(), "could not save a reply; the request runs again later");
                    let _ = self.storage.reset_requests(&[reply.request_id()]).await;
                }
            }
        }
    }
}

/// What a delivered request will produce.
enum Outcome {
    /// The exit of a unary request.
    Exit(oneshot::Receiver<Exit>),
    /// The chunks and final reply of a streaming request.
    Stream(mpsc::Receiver<Reply>),
}

/// The messages of entity types not registered here (yet).
///
/// - Each type's messages are held for twice the registration timeout from the first one seen.
///   A layer may still be registering the type (the storage read loop of
///   `effect/src/cluster/Sharding.ts`).
/// - Then they are answered with a defect.
/// - The deadline belongs to each type and is forgotten when the type registers.
///   So a type added later (a rolling update) gets its own.
#[derive(Default)]
struct Unregistered {
    /// When a message for each type was first seen.
    since: BTreeMap<EntityType, Instant>,
    /// The messages held since the last warning, per type.
    held: BTreeMap<EntityType, usize>,
}

impl Unregistered {
    /// Whether a message of `entity_type` is held for now (`false`: its deadline passed).
    fn hold(&mut self, entity_type: &EntityType, timeout: Duration) -> bool {
        let since = *self.since.entry(entity_type.clone()).or_insert_with(Instant::now);
        if since.elapsed() >= timeout.saturating_mul(2) {
            return false;
        }
        *self.held.entry(entity_type.clone()).or_default() += 1;
        true
    }

    /// `entity_type` is registered: its deadline is forgotten.
    fn registered(&mut self, entity_type: &EntityType) {
        if !self.since.is_empty() {
            self.since.remove(entity_type);
        }
    }

    /// Warns about the messages held: once per type and read, not once per message.
    fn warn(&mut self) {
        for (entity_type, messages) in std::mem::take(&mut self.held) {
            tracing::warn!(%entity_type, messages, "Could not find entity manager for address, retrying");
        }
    }
}

/// What the storage read loop remembers between reads.
#[derive(Default)]
struct ReadState {
    unregistered: Unregistered,
    /// A request found its entity's mailbox full.
    retry_soon: bool,
    /// The residency cap held requests back (or was reached).
    capped: bool,
    /// A newcomer was refused at the cap because no resident instance was idle: reads take
    /// only the residents' messages until the cap is no longer reached.
    residents_only: bool,
}

/// What one read did.
struct Read {
    /// It returned a whole batch: there may be more.
    full: bool,
    /// It delivered something.
    delivered: bool,
}

/// A request handed to its entity, and what the runtime keeps to store its outcome.
struct Sent {
    request_id: Snowflake,
    /// The request's shard, whose lock must be confirmed before its final reply is stored.
    shard: ShardId,
    outcome: Outcome,
    transaction: Option<PendingTransaction>,
    /// The request itself, kept when an interrupt runs it again.
    rerun: Option<Request>,
    /// Holds the shard's release until the outcome is stored.
    write: WriteGuard,
}

/// What a dispatch did with one stored message.
enum Dispatched {
    /// Handed to its entity.
    Delivered,
    /// Nothing to do now.
    Skipped,
    /// Its outcome is being stored, or was during the current read.
    /// Release the claim a read took, in case the outcome was to run again.
    Settled(Snowflake),
    /// Not deliverable now: release its claim so a later read retries it.
    Release(Snowflake),
    /// The entity's mailbox is full: release its claim and read again soon.
    Retry(Snowflake),
    /// The runner holds as many entities as it may.
    /// Release its claim, and read again once an entity is reaped.
    Capped(Snowflake),
    /// Answer it at once with this final reply.
    Answer(Reply),
}

/// The error of a persisted request in a runtime without a message storage.
pub(crate) fn not_stored(address: &EntityAddress) -> ClusterError {
    ClusterError::EntityNotAssignedToRunner { address: address.clone() }
}
