//! The entity manager: one per registered entity type (reference §6).
//!
//! It keeps the resident instances of its type, one tokio task each, fed by a bounded mailbox.
//! An instance is created on its first request, handles requests one at a time in delivery
//! order, is reaped after `max_idle_time` without requests, and is restarted (with backoff)
//! when a handler panics, replaying the request that was running: the reference's defect
//! restart. Admission is decided under the manager's lock, so a request either reaches a live
//! instance or fails at once with a typed error.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cluster_core::config::Capacity;
use cluster_core::envelope::{Chunk, Exit, Reply, Request, WithExit};
use cluster_core::future::BoxFuture;
use cluster_core::{ClusterError, EntityAddress, EntityId, EntityType, Snowflake};
use futures_util::FutureExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::entity::{
    CallKind, ChunkChannel, Entity, Ids, Protocol, RequestContext, TransactionSlot, malformed,
};
use crate::keep_alive::{KEEP_ALIVE_TAG, KeepAlive, KeepAliveHandle, KeepAliveSender};
use crate::metrics;

/// The largest mailbox channel; an unbounded mailbox capacity is capped here (everything has a
/// limit).
const MAILBOX_CHANNEL_MAX: usize = 1 << 16;

/// The restart backoff after a handler panic: 500 ms growing by half each time, at most 10 s
/// (the reference's default `defectRetryPolicy`).
const RESTART_BACKOFF_FIRST: Duration = Duration::from_millis(500);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// A request handed to an instance, with where its exit goes.
pub(crate) struct Delivery {
    pub(crate) request: Request,
    /// Cancelled when the request is interrupted.
    pub(crate) cancellation: CancellationToken,
    pub(crate) reply: ReplyTo,
    /// The storage transaction the handler runs in (persisted `WITH_TRANSACTION` requests).
    pub(crate) transaction: Option<TransactionSlot>,
}

/// Where the outcome of a request goes.
pub(crate) enum ReplyTo {
    /// The exit of a unary request.
    Exit(oneshot::Sender<Exit>),
    /// The chunks and then the final reply of a streaming request, and its acknowledgements.
    Stream(StreamReplies),
}

/// The channels of a streaming request.
pub(crate) struct StreamReplies {
    /// Chunks, then the final reply.
    pub(crate) replies: mpsc::Sender<Reply>,
    /// The ids of acknowledged chunks.
    pub(crate) acks: mpsc::Receiver<Snowflake>,
    /// The last chunk sent before a restart, for a resumed stream.
    pub(crate) last_sent: Option<Chunk>,
}

/// The runner-wide number of resident instances, bounded by `max_resident_entities`.
#[derive(Debug)]
pub(crate) struct Residency {
    count: AtomicUsize,
    cap: Capacity,
    /// Woken when a slot frees up: the storage read loop retries the requests it held back.
    freed: tokio::sync::Notify,
}

impl Residency {
    pub(crate) fn new(cap: Capacity) -> Residency {
        Residency { count: AtomicUsize::new(0), cap, freed: tokio::sync::Notify::new() }
    }

    /// Whether no further instance can be created.
    pub(crate) fn is_full(&self) -> bool {
        self.cap.is_full(self.count.load(Ordering::Acquire))
    }

    /// Completes when a slot frees up after the call.
    pub(crate) fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    fn try_reserve(&self) -> bool {
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |count| {
                (!self.cap.is_full(count)).then_some(count + 1)
            })
            .is_ok()
    }

    fn release(&self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        self.freed.notify_waiters();
    }
}

/// Why a delivery was refused.
#[derive(Debug)]
pub(crate) enum Refused {
    /// The runner holds as many instances as it may (`max_resident_entities`): retry once one
    /// is reaped. Callers see `MailboxFull`.
    ResidencyFull(EntityAddress),
    /// Anything else (the instance's mailbox is full, the manager is stopping).
    Cluster(ClusterError),
}

impl From<Refused> for ClusterError {
    fn from(refused: Refused) -> ClusterError {
        match refused {
            Refused::ResidencyFull(address) => ClusterError::MailboxFull { address },
            Refused::Cluster(error) => error,
        }
    }
}

/// What the runtime needs from a manager, whatever its entity type.
pub(crate) trait ErasedManager: Send + Sync {
    /// Hands `delivery` to its instance, creating it if needed.
    fn deliver(&self, delivery: Delivery) -> Result<(), Refused>;

    /// The addresses of the resident instances.
    fn resident_addresses(&self) -> Vec<EntityAddress>;

    /// The number of resident instances.
    fn active_entities(&self) -> usize;

    /// Whether requests tagged `tag` are streaming requests.
    fn is_stream(&self, tag: &str) -> bool;

    /// Whether requests tagged `tag` run inside a storage transaction.
    fn with_transaction(&self, tag: &str) -> bool;

    /// Whether requests tagged `tag` run again when they end by interrupt.
    fn rerun_on_interrupt(&self, tag: &str) -> bool;

    /// Stops every instance and waits for them to end: no new request is admitted, the ones
    /// already delivered get `termination_timeout` to finish (the reference's graceful drain,
    /// `entityTerminationTimeout`), then the rest are interrupted.
    fn shutdown(&self, termination_timeout: Duration) -> BoxFuture<'_, ()>;
}

/// The settings of one manager.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ManagerOptions {
    pub(crate) max_idle_time: Option<Duration>,
    pub(crate) mailbox_capacity: Capacity,
}

/// The manager of entity type `E`.
pub(crate) struct EntityManager<E: Entity> {
    shared: Arc<Shared<E>>,
}

struct Shared<E: Entity> {
    entity_type: EntityType,
    protocol: Protocol<E>,
    options: ManagerOptions,
    residency: Arc<Residency>,
    ids: Arc<Ids>,
    instances: Mutex<BTreeMap<EntityId, Instance>>,
    /// Consecutive restarts of this type, for the backoff (as in the reference, the schedule
    /// belongs to the type).
    restarts: AtomicUsize,
    /// Set when the manager stops: no request is admitted any more.
    stopping: CancellationToken,
    /// Set when the graceful drain is over: running requests are interrupted.
    closed: CancellationToken,
    tasks: TaskTracker,
    /// Sends the keep-alive request (see [`crate::keep_alive`]).
    keep_alive_sender: KeepAliveSender,
}

struct Instance {
    address: EntityAddress,
    mailbox: mpsc::Sender<Delivery>,
    /// Requests admitted and not yet answered: the mailbox size of the reference.
    active: Arc<AtomicUsize>,
    /// Parked keep-alive requests keep the instance resident.
    keep_alive: Arc<KeepAlive>,
}

impl<E: Entity> EntityManager<E> {
    pub(crate) fn new(
        options: ManagerOptions,
        residency: Arc<Residency>,
        ids: Arc<Ids>,
        keep_alive_sender: KeepAliveSender,
    ) -> EntityManager<E> {
        EntityManager {
            shared: Arc::new(Shared {
                entity_type: EntityType::from(E::TYPE),
                protocol: Protocol::of(),
                options,
                residency,
                ids,
                instances: Mutex::new(BTreeMap::new()),
                restarts: AtomicUsize::new(0),
                stopping: CancellationToken::new(),
                closed: CancellationToken::new(),
                tasks: TaskTracker::new(),
                keep_alive_sender,
            }),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here only inserts or removes map entries: a panic cannot leave
    // the map half-changed.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<E: Entity> ErasedManager for EntityManager<E> {
    fn deliver(&self, delivery: Delivery) -> Result<(), Refused> {
        let shared = &self.shared;
        let address = delivery.request.address.clone();
        let mut instances = lock(&shared.instances);
        if shared.stopping.is_cancelled() {
            return Err(Refused::Cluster(ClusterError::EntityNotAssignedToRunner { address }));
        }
        if !instances.contains_key(&address.entity_id) {
            if !shared.residency.try_reserve() {
                return Err(Refused::ResidencyFull(address));
            }
            let instance = Shared::spawn(shared, address.clone());
            instances.insert(address.entity_id.clone(), instance);
            metrics::set_for_type(metrics::ENTITIES, shared.entity_type.as_str(), instances.len());
        }
        let Some(instance) = instances.get(&address.entity_id) else {
            return Err(Refused::Cluster(ClusterError::EntityNotAssignedToRunner { address }));
        };
        if &*delivery.request.tag == KEEP_ALIVE_TAG {
            // Not a mailbox request: it activates the entity and waits on its latch.
            tracing::debug!(entity_type = %shared.entity_type, entity_id = %address.entity_id, "keep-alive");
            instance.keep_alive.park(delivery);
            return Ok(());
        }
        if shared.options.mailbox_capacity.is_full(instance.active.load(Ordering::Acquire)) {
            return Err(Refused::Cluster(ClusterError::MailboxFull { address }));
        }
        instance.active.fetch_add(1, Ordering::AcqRel);
        if instance.mailbox.try_send(delivery).is_err() {
            // Full (an unbounded capacity past the channel's cap) or closed (the instance is
            // stopping): either way this request is not admitted.
            instance.active.fetch_sub(1, Ordering::AcqRel);
            return Err(Refused::Cluster(ClusterError::MailboxFull { address }));
        }
        tracing::trace!(entity_type = %shared.entity_type, entity_id = %address.entity_id, "delivered");
        Ok(())
    }

    fn active_entities(&self) -> usize {
        lock(&self.shared.instances).len()
    }

    fn resident_addresses(&self) -> Vec<EntityAddress> {
        lock(&self.shared.instances).values().map(|instance| instance.address.clone()).collect()
    }

    fn is_stream(&self, tag: &str) -> bool {
        self.shared.protocol.get(tag).is_some_and(|entry| matches!(entry.call, CallKind::Stream(_)))
    }

    fn with_transaction(&self, tag: &str) -> bool {
        self.shared.protocol.get(tag).is_some_and(|entry| entry.with_transaction)
    }

    fn rerun_on_interrupt(&self, tag: &str) -> bool {
        self.shared.protocol.get(tag).is_some_and(|entry| entry.rerun_on_interrupt)
    }

    fn shutdown(&self, termination_timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let shared = &self.shared;
            shared.stopping.cancel();
            // Dropping the mailboxes' senders ends each instance once its queue is done.
            lock(&shared.instances).clear();
            metrics::set_for_type(metrics::ENTITIES, shared.entity_type.as_str(), 0);
            shared.tasks.close();
            if tokio::time::timeout(termination_timeout, shared.tasks.wait()).await.is_err() {
                tracing::debug!(entity_type = %shared.entity_type, "termination timeout: interrupting");
                shared.closed.cancel();
                shared.tasks.wait().await;
            }
            shared.closed.cancel();
        })
    }
}

impl<E: Entity> Shared<E> {
    fn spawn(shared: &Arc<Shared<E>>, address: EntityAddress) -> Instance {
        let capacity =
            shared.options.mailbox_capacity.limit().map_or(MAILBOX_CHANNEL_MAX, |limit| {
                usize::try_from(limit.get()).unwrap_or(MAILBOX_CHANNEL_MAX).min(MAILBOX_CHANNEL_MAX)
            });
        let (mailbox, receiver) = mpsc::channel(capacity);
        let active = Arc::new(AtomicUsize::new(0));
        let keep_alive = Arc::new(KeepAlive::default());
        let span = tracing::debug_span!(
            "entity",
            entity_type = %shared.entity_type,
            entity_id = %address.entity_id,
            shard = %address.shard_id,
        );
        let address_for_instance = address.clone();
        let handle = KeepAliveHandle {
            latch: Arc::clone(&keep_alive),
            send: Arc::clone(&shared.keep_alive_sender),
        };
        let task = run_instance(Arc::clone(shared), address, receiver, Arc::clone(&active), handle);
        shared.tasks.spawn(task.instrument(span));
        Instance { address: address_for_instance, mailbox, active, keep_alive }
    }

    /// Removes the instance if it is idle: nothing running, nothing queued. Under the lock, so
    /// no request can be admitted in between.
    fn retire(&self, address: &EntityAddress, receiver: &mpsc::Receiver<Delivery>) -> bool {
        let mut instances = lock(&self.instances);
        let idle = instances.get(&address.entity_id).is_some_and(|instance| {
            instance.active.load(Ordering::Acquire) == 0 && !instance.keep_alive.is_enabled()
        }) && receiver.is_empty();
        if idle {
            instances.remove(&address.entity_id);
            metrics::set_for_type(metrics::ENTITIES, self.entity_type.as_str(), instances.len());
        }
        idle
    }

    async fn backoff(&self) {
        let restarts = self.restarts.fetch_add(1, Ordering::AcqRel);
        let mut delay = RESTART_BACKOFF_FIRST;
        for _ in 0..restarts.min(16) {
            delay = delay.mul_f64(1.5).min(RESTART_BACKOFF_MAX);
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = self.closed.cancelled() => {}
        }
    }
}

/// The chunk channel of a streaming delivery. The acknowledgement receiver moves into the
/// channel for the run and back when the run ends (a restarted run gets it again).
fn chunk_channel<E: Entity>(
    shared: &Shared<E>,
    request: &Request,
    stream: &mut StreamReplies,
) -> ChunkChannel {
    let (_, empty) = mpsc::channel(1);
    let next_sequence = stream.last_sent.as_ref().map_or(0, |chunk| chunk.sequence() + 1);
    ChunkChannel {
        request_id: request.request_id,
        next_sequence,
        last_sent: stream.last_sent.clone(),
        replies: stream.replies.clone(),
        acks: std::mem::replace(&mut stream.acks, empty),
        ids: Arc::clone(&shared.ids),
    }
}

/// What became of one handler run.
enum Outcome {
    Exited(Exit),
    Panicked,
}

async fn run_instance<E: Entity>(
    shared: Arc<Shared<E>>,
    address: EntityAddress,
    mut receiver: mpsc::Receiver<Delivery>,
    active: Arc<AtomicUsize>,
    keep_alive: KeepAliveHandle,
) {
    let Some(mut entity) = create(&shared, &address).await else {
        keep_alive.latch.abandon();
        shared.residency.release();
        return;
    };
    while let Some(mut delivery) = next_delivery(&shared, &address, &mut receiver).await {
        let exit = loop {
            match run_one(&shared, &mut entity, &address, &mut delivery, &keep_alive).await {
                Outcome::Exited(exit) => break exit,
                Outcome::Panicked => {
                    tracing::warn!(entity_type = %shared.entity_type, entity_id = %address.entity_id, "defect in entity, restarting");
                    shared.backoff().await;
                    match create(&shared, &address).await {
                        Some(created) => entity = created,
                        None => break Exit::interrupt(),
                    }
                }
            }
        };
        // The caller may have gone away (an interrupted request).
        match delivery.reply {
            ReplyTo::Exit(reply) => {
                let _ = reply.send(exit);
            }
            ReplyTo::Stream(stream) => {
                let with_exit = WithExit {
                    request_id: delivery.request.request_id,
                    id: shared.ids.next(),
                    exit,
                };
                let _ = stream.replies.send(Reply::WithExit(with_exit)).await;
            }
        }
        active.fetch_sub(1, Ordering::AcqRel);
    }
    keep_alive.latch.abandon();
    shared.residency.release();
}

/// Creates the instance, retrying with backoff if `create` panics; `None` once the manager
/// closed.
async fn create<E: Entity>(shared: &Shared<E>, address: &EntityAddress) -> Option<E> {
    loop {
        if shared.closed.is_cancelled() {
            return None;
        }
        match AssertUnwindSafe(E::create(address)).catch_unwind().await {
            Ok(entity) => return Some(entity),
            Err(_) => {
                tracing::warn!(entity_type = %shared.entity_type, entity_id = %address.entity_id, "defect creating entity, retrying");
                shared.backoff().await;
            }
        }
    }
}

/// The next request, or `None` when the instance ends: reaped for idleness or stopped.
async fn next_delivery<E: Entity>(
    shared: &Shared<E>,
    address: &EntityAddress,
    receiver: &mut mpsc::Receiver<Delivery>,
) -> Option<Delivery> {
    loop {
        let Some(idle) = shared.options.max_idle_time else {
            return receiver.recv().await;
        };
        match tokio::time::timeout(idle, receiver.recv()).await {
            Ok(delivery) => return delivery,
            Err(_) if shared.retire(address, receiver) => return None,
            Err(_) => {}
        }
    }
}

async fn run_one<E: Entity>(
    shared: &Shared<E>,
    entity: &mut E,
    address: &EntityAddress,
    delivery: &mut Delivery,
    keep_alive: &KeepAliveHandle,
) -> Outcome {
    let request = &delivery.request;
    let Some(entry) = shared.protocol.get(&request.tag) else {
        let message =
            format!("entity type {} has no request {:?}", shared.entity_type, request.tag);
        return Outcome::Exited(malformed(&message));
    };
    if delivery.cancellation.is_cancelled() || shared.closed.is_cancelled() {
        return Outcome::Exited(Exit::interrupt());
    }
    let context = RequestContext::new(
        address.clone(),
        request.request_id,
        delivery.cancellation.clone(),
        delivery.transaction.clone(),
        keep_alive.clone(),
    );
    let span = tracing::debug_span!(
        "request",
        entity_type = %address.entity_type,
        entity_id = %address.entity_id,
        shard = %address.shard_id,
        request_id = %request.request_id,
        tag = %request.tag,
    );
    let mut channel = match (&entry.call, &mut delivery.reply) {
        (CallKind::Stream(_), ReplyTo::Stream(stream)) => {
            Some(chunk_channel(shared, request, stream))
        }
        (CallKind::Stream(_), ReplyTo::Exit(_)) => {
            return Outcome::Exited(malformed(
                "a streaming request was delivered without a stream",
            ));
        }
        (CallKind::Unary(_), _) => None,
    };
    let call = match (&entry.call, channel.as_mut()) {
        (CallKind::Stream(call), Some(channel)) => {
            call(entity, &context, &request.payload, channel)
        }
        (CallKind::Unary(call), _) => call(entity, &context, &request.payload),
        (CallKind::Stream(_), None) => return Outcome::Exited(malformed("no stream channel")),
    };
    let handled = AssertUnwindSafe(call).catch_unwind().instrument(span);
    // Requests that do not wait for the graceful drain are cut off when stopping begins.
    let stopping = async {
        if entry.interrupt_on_termination {
            shared.stopping.cancelled().await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let outcome = tokio::select! {
        biased;
        () = delivery.cancellation.cancelled() => Outcome::Exited(Exit::interrupt()),
        () = shared.closed.cancelled() => Outcome::Exited(Exit::interrupt()),
        () = stopping => Outcome::Exited(Exit::interrupt()),
        handled = handled => match handled {
            Ok(exit) => Outcome::Exited(exit),
            Err(_) => Outcome::Panicked,
        },
    };
    // Give the stream's acknowledgements back, so that a restarted run continues the stream.
    if let (Some(channel), ReplyTo::Stream(stream)) = (channel, &mut delivery.reply) {
        stream.acks = channel.acks;
        stream.last_sent = channel.last_sent;
    }
    outcome
}
