//! The entity manager: one per registered entity type
//! (`effect/src/cluster/internal/entityManager.ts`).
//!
//! It keeps the resident instances of its type, one tokio task each, fed by a bounded mailbox.
//! An instance is created on its first request, starts requests in delivery order (exclusive
//! ones alone, shared ones up to the type's concurrency at once, see [`InstanceLoop`]), is
//! reaped after `max_idle_time` without requests, and is restarted (with backoff) when a
//! handler panics, replaying the requests that were running: the reference's defect restart.
//! Admission is decided under the manager's lock, so a request either reaches a live instance or
//! fails at once with a typed error.

use std::collections::{BTreeMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::backoff::Backoff;
use cluster_core::config::Capacity;
use cluster_core::entity_state::StoredState;
use cluster_core::envelope::{Exit, RawJson, Reply, Request, WithExit};
use cluster_core::future::BoxFuture;
use cluster_core::storage::MessageStorage;
use cluster_core::sync::lock;
use cluster_core::{ClusterError, EntityAddress, EntityType, ShardId, Snowflake};
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::api::entity::{
    CallKind, ChunkChannel, Entity, EntityContext, Ids, Protocol, RequestContext, SharedValue,
    Sharing, malformed,
};
use crate::api::state::{Change, Committed, StateCell, StateHandOff};
use crate::metrics::{self, FailReason};
use crate::runtime::delivery::{
    Delivery, ErasedManager, PendingTransaction, Refused, ReplyTo, Serving, StreamReplies,
};
use crate::runtime::interrupt::{FlaggedToken, InterruptSignal};
use crate::runtime::keep_alive::{KEEP_ALIVE_TAG, KeepAlive, KeepAliveHandle, KeepAliveSender};
use instances::{Instances, Partition};

/// The largest mailbox channel; an unbounded mailbox capacity is capped here (everything has a
/// limit).
const MAILBOX_CHANNEL_MAX: usize = 1 << 16;

/// The restart backoff after a handler panic: 500 ms growing by half each time, at most 10 s
/// (the reference's default `defectRetryPolicy`).
const RESTART_BACKOFF_FIRST: Duration = Duration::from_millis(500);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A type that went this long without a restart starts its backoff afresh. The reference
/// never resets it, so that one bad hour leaves every later restart of the type at 10 s.
const RESTART_BACKOFF_RESET: Duration = Duration::from_secs(60);

/// The restart backoff of an entity type: 500 ms, growing by half per restart, at most 10 s,
/// and back to 500 ms after [`RESTART_BACKOFF_RESET`] without a restart.
#[derive(Debug)]
pub(crate) struct RestartBackoff {
    backoff: Backoff,
    last: Option<tokio::time::Instant>,
}

impl Default for RestartBackoff {
    fn default() -> RestartBackoff {
        let backoff = Backoff::new(RESTART_BACKOFF_FIRST, RESTART_BACKOFF_MAX, 3, 2);
        RestartBackoff { backoff, last: None }
    }
}

impl RestartBackoff {
    /// The delay before a restart that begins at `now`.
    pub(crate) fn next(&mut self, now: tokio::time::Instant) -> Duration {
        if self.last.is_some_and(|last| now.duration_since(last) >= RESTART_BACKOFF_RESET) {
            self.backoff.reset();
        }
        self.last = Some(now);
        self.backoff.next_delay()
    }
}

/// The runner-wide number of resident instances, bounded by `max_resident_entities`.
///
/// At the cap, a new instance makes room: the least recently used idle instances (nothing
/// running, nothing queued, no keep-alive) are passivated, as Akka's least-recently-used
/// passivation strategy does. A passivated instance leaves the count at once and runs its
/// `on_stop` outside it; at most `cap` instances are passivating at a time, so that the tasks
/// alive stay under twice the cap. A request that reaches a passivating instance takes it back
/// into the count, even past the cap: it was resident all along.
pub(crate) struct Residency {
    /// Live instances that are not passivating.
    count: AtomicUsize,
    cap: Capacity,
    /// Instances told to passivate whose tasks have not ended.
    passivating: AtomicUsize,
    /// Woken when a slot frees up: the storage read loop retries the requests it held back.
    freed: tokio::sync::Notify,
    /// The managers whose idle instances can be passivated.
    managers: Mutex<Vec<std::sync::Weak<dyn Passivate>>>,
    /// Held while room is made, so that concurrent newcomers do not each passivate a batch;
    /// it holds when the last scan that found nothing idle ends its quiet period.
    making_room: Mutex<Quiet>,
}

impl std::fmt::Debug for Residency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Residency")
            .field("count", &self.count)
            .field("cap", &self.cap)
            .field("passivating", &self.passivating)
            .finish_non_exhaustive()
    }
}

impl Residency {
    pub(crate) fn new(cap: Capacity) -> Residency {
        Residency {
            count: AtomicUsize::new(0),
            cap,
            passivating: AtomicUsize::new(0),
            freed: tokio::sync::Notify::new(),
            managers: Mutex::new(Vec::new()),
            making_room: Mutex::new(Quiet::default()),
        }
    }

    /// Whether no further instance can be created without passivating one.
    pub(crate) fn is_full(&self) -> bool {
        self.cap.is_full(self.count.load(Ordering::Acquire))
    }

    /// Completes when a slot frees up after the call.
    pub(crate) fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// Lets the idle instances of `manager` be passivated to make room.
    fn register(&self, manager: std::sync::Weak<dyn Passivate>) {
        let mut managers = lock(&self.managers);
        managers.retain(|manager| manager.strong_count() > 0);
        managers.push(manager);
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

    /// Whether one more instance may start passivating.
    fn may_passivate(&self) -> bool {
        !self.cap.is_full(self.passivating.load(Ordering::Acquire))
    }

    /// An instance starts passivating: its slot is free at once.
    fn passivated(&self) {
        self.passivating.fetch_add(1, Ordering::AcqRel);
        self.release();
    }

    /// A passivating instance got a request: it counts again.
    fn revived(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
        self.passivating.fetch_sub(1, Ordering::AcqRel);
    }

    /// A passivating instance's task ended; its slot was freed when it started.
    fn passivation_ended(&self) {
        self.passivating.fetch_sub(1, Ordering::AcqRel);
    }

    /// Passivates up to a batch of the least recently used idle instances of every registered
    /// type, unless room was made meanwhile. Whether there is room now.
    fn make_room(&self) -> bool {
        let mut quiet = lock(&self.making_room);
        if !self.is_full() {
            return true;
        }
        if quiet.holds() {
            return false;
        }
        let managers: Vec<Arc<dyn Passivate>> =
            lock(&self.managers).iter().filter_map(std::sync::Weak::upgrade).collect();
        let batch = room_batch(self.cap);
        let passivated = passivate_least_recent(&managers, batch, self);
        quiet.after(passivated);
        passivated > 0 && !self.is_full()
    }
}

/// How long newcomers skip the scan for idle instances after one that found none.
const QUIET_AFTER_FRUITLESS_SCAN: Duration = Duration::from_millis(50);

/// The quiet period after a scan that found no idle instance: while every resident instance
/// is busy, a flood of new ids would otherwise scan all of them once per id.
#[derive(Default)]
pub(crate) struct Quiet {
    until: Option<tokio::time::Instant>,
}

impl Quiet {
    /// Whether a scan is to be skipped now.
    fn holds(&self) -> bool {
        self.until.is_some_and(|until| tokio::time::Instant::now() < until)
    }

    /// Records a scan that passivated `passivated` instances.
    fn after(&mut self, passivated: usize) {
        self.until =
            (passivated == 0).then(|| tokio::time::Instant::now() + QUIET_AFTER_FRUITLESS_SCAN);
    }
}

/// How many instances one attempt to make room passivates: a 64th of the cap, at least one, so
/// that a flood of new ids scans the resident instances once per 64th of the cap (not once per
/// id), and a newcomer rarely waits on a scan.
fn room_batch(cap: Capacity) -> usize {
    cap.limit().map_or(1, |limit| usize::try_from(limit.get() / 64).unwrap_or(1).max(1))
}

/// When an instance was last given a request: the greatest id of its requests. Snowflakes grow
/// with time, so this orders instances by recency without reading a clock on every request
/// (an old persisted request delivered late does not make its instance look older).
type LastUsed = Snowflake;

/// One idle instance that may be passivated to make room.
pub(crate) struct Candidate {
    /// When the instance was last given a request.
    last_used: LastUsed,
    shard: ShardId,
    id: cluster_core::EntityId,
    /// Its manager, by position in the list the candidates came from.
    manager: usize,
}

/// The managers' side of making room.
pub(crate) trait Passivate: Send + Sync {
    /// Adds the idle instances of the type to `out`, as candidates of manager `manager`.
    fn idle_instances(&self, manager: usize, out: &mut Vec<Candidate>);
    /// Passivates the candidate if it is still idle and was not used since; whether it did.
    fn passivate(&self, candidate: &Candidate, residency: &Residency) -> bool;
}

/// Passivates up to `batch` of the least recently used idle instances of `managers`; how many.
fn passivate_least_recent(
    managers: &[Arc<dyn Passivate>],
    batch: usize,
    residency: &Residency,
) -> usize {
    let mut candidates = Vec::new();
    for (index, manager) in managers.iter().enumerate() {
        manager.idle_instances(index, &mut candidates);
    }
    if candidates.is_empty() {
        return 0;
    }
    let batch = batch.min(candidates.len());
    if batch < candidates.len() {
        candidates.select_nth_unstable_by_key(batch - 1, |candidate| candidate.last_used);
        candidates.truncate(batch);
    }
    candidates.sort_unstable_by_key(|candidate| candidate.last_used);
    let mut passivated = 0;
    for candidate in &candidates {
        if !residency.may_passivate() {
            break;
        }
        if managers[candidate.manager].passivate(candidate, residency) {
            passivated += 1;
        }
    }
    passivated
}

/// The requests an instance admitted and has not answered yet, by id.
///
/// A sorted `VecDeque` rather than a `BTreeSet`: a set that goes from empty to one id and back
/// with every request allocated and freed a tree node each time, while the deque keeps its
/// room. Ids mostly arrive in increasing order (snowflakes) and leave from the front, so the
/// insertion and removal move few or no elements.
#[derive(Default)]
struct Active {
    ids: Mutex<VecDeque<Snowflake>>,
    /// The entity's `effect_cluster_entity_mailbox_size` series, with `entity_mailbox_metrics`.
    gauge: Option<::metrics::Gauge>,
    /// Set (under the partition's lock) when the instance was told to passivate to make room,
    /// cleared when a request takes it back or its task ends: whichever clears it settles the
    /// instance's place in the residency count.
    passivating: AtomicBool,
    /// Wakes the idle instance to passivate.
    passivate: tokio::sync::Notify,
}

impl Drop for Active {
    fn drop(&mut self) {
        // The instance and its requests are gone; the facade cannot remove the series.
        if let Some(gauge) = &self.gauge {
            crate::metrics::set_mailbox(gauge, 0);
        }
    }
}

/// Whether a request was admitted into an instance's mailbox.
enum Admission {
    Admitted,
    /// The mailbox holds `mailbox_capacity` requests.
    Full,
    /// A request with this id is already there (`AlreadyProcessingMessage`).
    Duplicate,
}

/// The room an emptied [`Active`] keeps; past it, the room of a burst is given back.
const ACTIVE_ROOM_KEPT: usize = 64;

impl Active {
    /// An empty mailbox that reports its size to `gauge`, if any.
    fn reporting(gauge: Option<::metrics::Gauge>) -> Active {
        if let Some(gauge) = &gauge {
            crate::metrics::set_mailbox(gauge, 0);
        }
        Active {
            ids: Mutex::default(),
            gauge,
            passivating: AtomicBool::new(false),
            passivate: tokio::sync::Notify::new(),
        }
    }

    fn admit(&self, request_id: Snowflake, capacity: Capacity) -> Admission {
        let mut ids = lock(&self.ids);
        match ids.binary_search(&request_id) {
            Ok(_) => Admission::Duplicate,
            Err(_) if capacity.is_full(ids.len()) => Admission::Full,
            Err(position) => {
                ids.insert(position, request_id);
                if let Some(gauge) = &self.gauge {
                    crate::metrics::set_mailbox(gauge, ids.len());
                }
                Admission::Admitted
            }
        }
    }

    fn finish(&self, request_id: Snowflake) {
        let mut ids = lock(&self.ids);
        if let Ok(position) = ids.binary_search(&request_id) {
            ids.remove(position);
            if let Some(gauge) = &self.gauge {
                crate::metrics::set_mailbox(gauge, ids.len());
            }
        }
        if ids.is_empty() && ids.capacity() > ACTIVE_ROOM_KEPT {
            ids.shrink_to(ACTIVE_ROOM_KEPT);
        }
    }

    fn is_empty(&self) -> bool {
        lock(&self.ids).is_empty()
    }
}

/// The settings of one manager.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ManagerOptions {
    pub(crate) max_idle_time: Option<Duration>,
    pub(crate) mailbox_capacity: Capacity,
    /// How many shared requests of one instance run at once.
    pub(crate) concurrency: Capacity,
    /// How long `Entity::on_stop` may take.
    pub(crate) on_stop_timeout: Duration,
    /// The pause before a `WITH_TRANSACTION` request's transaction is begun again after a
    /// failure (`send_retry_interval`).
    pub(crate) transaction_retry: Duration,
    /// Report each instance's mailbox size (`entity_mailbox_metrics`).
    pub(crate) mailbox_metrics: bool,
    /// How many instances of the type may be resident ([`EntityOptions::max_resident`]).
    ///
    /// [`EntityOptions::max_resident`]: crate::api::entity::EntityOptions::max_resident
    pub(crate) max_resident: Capacity,
    /// What a handler's panic does to its request.
    pub(crate) defects: crate::api::entity::Defects,
}

/// Makes the context of a new instance at an address; `None` once the runtime is gone. The
/// runtime gives it, so that a manager neither names nor keeps alive the runtime.
pub(crate) type Contexts = Arc<dyn Fn(&EntityAddress) -> Option<EntityContext> + Send + Sync>;

/// What makes the instances of an entity type.
pub(crate) enum Factory<E> {
    /// [`Entity::create`], boxed. A function pointer that a registration without a factory takes: the
    /// manager itself never names `E::create`, so an entity type registered only with a
    /// factory needs none (see `EntityRegistration::factory`).
    Create(for<'a> fn(&'a EntityContext) -> BoxFuture<'a, E>),
    /// The factory of `EntityRegistration::factory`.
    With(Arc<dyn Fn(&EntityContext) -> E + Send + Sync>),
    /// The factory of `EntityRegistration::factory_async`.
    WithAsync(Arc<dyn Fn(EntityContext) -> BoxFuture<'static, E> + Send + Sync>),
}

impl<E: Entity> Factory<E> {
    /// The factory that calls [`Entity::create`].
    pub(crate) fn create() -> Factory<E> {
        Factory::Create(|context| Box::pin(E::create(context)))
    }

    /// A new instance for `context`.
    async fn make(&self, context: &EntityContext) -> E {
        match self {
            Factory::Create(create) => create(context).await,
            Factory::With(factory) => factory(context),
            Factory::WithAsync(factory) => factory(context.clone()).await,
        }
    }
}

/// The manager of entity type `E`.
pub(crate) struct EntityManager<E: Entity> {
    shared: Arc<Shared<E>>,
}

struct Shared<E: Entity> {
    /// Makes the context of a new instance (what it gets to call other entities).
    contexts: Contexts,
    entity_type: EntityType,
    protocol: Protocol<E>,
    /// Makes the instances.
    factory: Factory<E>,
    options: ManagerOptions,
    residency: Arc<Residency>,
    ids: Arc<Ids>,
    instances: Instances<Instance>,
    /// The restart backoff; as in the reference, it belongs to the type, not to an instance.
    restarts: Mutex<RestartBackoff>,
    /// Set when the manager stops: no request is admitted any more (every delivery reads its
    /// flag).
    stopping: FlaggedToken,
    /// Set when the graceful drain is over: running requests are interrupted.
    closed: CancellationToken,
    tasks: TaskTracker,
    /// Sends the keep-alive request (see [`crate::runtime::keep_alive`]).
    keep_alive_sender: KeepAliveSender,
    /// Instances in `instances` that were told to passivate: the type's cap does not count
    /// them. Changed under the lock of the partition that holds the instance.
    passivating: AtomicUsize,
    /// Held while room is made within the type, with the quiet period of its last scan.
    quiet: Mutex<Quiet>,
    /// Where the durable state of the type's instances is kept (the runtime's message
    /// storage), if the type declared one.
    state_storage: Option<Arc<dyn MessageStorage>>,
}

/// The stop signals of one instance.
#[derive(Clone)]
struct Signals {
    /// Set when the instance starts stopping (its shard is released, the manager stops):
    /// `InterruptOnTermination` requests are cut off.
    stopping: CancellationToken,
    /// Set when the graceful drain is over: running requests are interrupted.
    interrupt: CancellationToken,
    /// Set when the instance's task has ended.
    ended: CancellationToken,
}

struct Instance {
    address: EntityAddress,
    signals: Signals,
    /// Boxed: the channel allocates its slots 32 at a time, so an unboxed `Delivery`
    /// would cost every resident instance 32 of them (about 9 KiB) before its first request.
    mailbox: mpsc::Sender<Box<Delivery>>,
    /// Requests admitted and not yet answered: the mailbox of the reference.
    active: Arc<Active>,
    /// Parked keep-alive requests keep the instance resident.
    keep_alive: Arc<KeepAlive>,
    /// When the instance was last given a request: the least recently used idle instances are
    /// passivated first.
    last_used: LastUsed,
}

/// What the runtime lends every manager.
pub(crate) struct Lent {
    /// The runner-wide residency count.
    pub(crate) residency: Arc<Residency>,
    pub(crate) ids: Arc<Ids>,
    /// Sends the keep-alive request.
    pub(crate) keep_alive_sender: KeepAliveSender,
    /// The message storage, where durable entity state is kept, if the runtime has one.
    pub(crate) storage: Option<Arc<dyn MessageStorage>>,
}

impl<E: Entity> EntityManager<E> {
    pub(crate) fn new(
        contexts: Contexts,
        entity_type: EntityType,
        factory: Factory<E>,
        options: ManagerOptions,
        lent: Lent,
    ) -> EntityManager<E> {
        let Lent { residency, ids, keep_alive_sender, storage } = lent;
        let protocol = Protocol::of().measured(entity_type.as_str());
        let state_storage = storage.filter(|_| protocol.durability().is_some());
        let shared = Arc::new(Shared {
            contexts,
            entity_type,
            protocol,
            factory,
            options,
            residency,
            ids,
            instances: Instances::new(),
            restarts: Mutex::new(RestartBackoff::default()),
            stopping: FlaggedToken::default(),
            closed: CancellationToken::new(),
            tasks: TaskTracker::new(),
            keep_alive_sender,
            passivating: AtomicUsize::new(0),
            quiet: Mutex::new(Quiet::default()),
            state_storage,
        });
        let passivate: Arc<dyn Passivate> = shared.clone();
        shared.residency.register(Arc::downgrade(&passivate));
        EntityManager { shared }
    }
}

impl<E: Entity> EntityManager<E> {
    /// Admits a request to its instance's mailbox, creating the instance if it is not
    /// resident, or says why not.
    fn admit(&self, delivery: Box<Delivery>, serving: &dyn Serving) -> Result<(), Refused> {
        let shared = &self.shared;
        // The address is cloned only where it is kept (a new instance) or reported (a refusal).
        let address = || delivery.request.address.clone();
        let shard = &delivery.request.address.shard_id;
        let mut instances = shared.instances.partition(shard);
        // Under the partition's lock: `shutdown` cancels it before it clears the partitions, and
        // a shard's release stops serving it before it removes the shard's instances (the
        // reference's `hasShardId` check in `EntityManager.send`).
        let not_served = || shared.stopping.is_cancelled() || !serving.serves(shard);
        if not_served() {
            return Err(Refused::Cluster(ClusterError::EntityNotAssignedToRunner {
                address: address(),
            }));
        }
        let id = &delivery.request.address.entity_id;
        // At a cap, a newcomer makes room first, outside the partition's lock (making room
        // locks every partition in turn). The two atomic loads are all a resident pays.
        let runner_full = shared.residency.is_full();
        let type_full = shared.type_is_full();
        if (runner_full || type_full) && instances.get(id).is_none() {
            drop(instances);
            if type_full {
                shared.make_room_in_type();
            }
            if shared.residency.is_full() {
                shared.residency.make_room();
            }
            instances = shared.instances.partition(shard);
            if not_served() {
                return Err(Refused::Cluster(ClusterError::EntityNotAssignedToRunner {
                    address: address(),
                }));
            }
        }
        let instance = instances.get_or_try_insert(id, |resident| {
            // `resident` counts this newcomer.
            let counted = (resident - 1).saturating_sub(shared.passivating.load(Ordering::Acquire));
            if shared.options.max_resident.is_full(counted) || !shared.residency.try_reserve() {
                return Err(Refused::ResidencyFull(address()));
            }
            metrics::set_for_type(metrics::ENTITIES, shared.entity_type.as_str(), counted + 1);
            Ok(Shared::spawn(shared, address()))
        })?;
        instance.last_used = instance.last_used.max(delivery.request.request_id);
        // A load first: the flag is set under this partition's lock, which is held, and a
        // read-modify-write on every request would cost more than the load.
        if instance.active.passivating.load(Ordering::Acquire)
            && instance.active.passivating.swap(false, Ordering::AcqRel)
        {
            // Told to passivate, it is wanted again: it counts again.
            shared.revive();
        }
        if &*delivery.request.tag == KEEP_ALIVE_TAG {
            // Not a mailbox request: it activates the entity and waits on its latch.
            tracing::debug!(entity_type = %shared.entity_type, entity_id = %delivery.request.address.entity_id, "keep-alive");
            instance.keep_alive.park(*delivery);
            return Ok(());
        }
        let request_id = delivery.request.request_id;
        match instance.active.admit(request_id, shared.options.mailbox_capacity) {
            Admission::Admitted => {}
            Admission::Full => {
                return Err(Refused::Cluster(ClusterError::MailboxFull { address: address() }));
            }
            Admission::Duplicate => {
                return Err(Refused::Cluster(ClusterError::AlreadyProcessingMessage {
                    envelope_id: request_id,
                    address: address(),
                }));
            }
        }
        if let Err(refused) = instance.mailbox.try_send(delivery) {
            // Full (an unbounded capacity past the channel's cap) or closed (the instance is
            // stopping): either way this request is not admitted.
            instance.active.finish(request_id);
            let address = refused.into_inner().request.address;
            return Err(Refused::Cluster(ClusterError::MailboxFull { address }));
        }
        tracing::trace!(entity_type = %shared.entity_type, %request_id, "delivered");
        Ok(())
    }
}

impl<E: Entity> ErasedManager for EntityManager<E> {
    fn deliver(&self, delivery: Box<Delivery>, serving: &dyn Serving) -> Result<(), Refused> {
        let shared = &self.shared;
        let measured = shared.protocol.get(&delivery.request.tag).map(|entry| &entry.metrics);
        let kind = delivery.kind();
        if let Some(metrics) = measured {
            metrics.received(kind);
        }
        let refused = |refused: Refused| {
            if let Some(metrics) = measured {
                metrics.failed(kind, FailReason::Refused);
            }
            refused
        };
        self.admit(delivery, serving).map_err(refused)
    }

    fn active_entities(&self) -> usize {
        self.shared.resident()
    }

    fn resident_addresses(&self) -> Vec<EntityAddress> {
        self.shared.instances.collect(|instance| instance.address.clone())
    }

    fn is_stream(&self, tag: &str) -> bool {
        self.shared.protocol.get(tag).is_some_and(|entry| entry.call.is_stream())
    }

    fn with_transaction(&self, tag: &str, payload: &RawJson) -> bool {
        self.shared.protocol.get(tag).is_some_and(|entry| entry.with_transaction.of(payload))
    }

    fn has_state(&self) -> bool {
        self.shared.protocol.durability().is_some()
    }

    fn rerun_on_interrupt(&self, tag: &str) -> bool {
        self.shared.protocol.get(tag).is_some_and(|entry| entry.rerun_on_interrupt)
    }

    fn stop_shard<'a>(
        &'a self,
        shard: &'a ShardId,
        force: bool,
        termination_timeout: Duration,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let shared = &self.shared;
            loop {
                let stopped: Vec<Signals> = {
                    let mut instances = shared.instances.partition(shard);
                    // Removing an instance drops its mailbox: it ends once its queue is done.
                    let stopped = instances
                        .remove_where(|instance| instance.address.shard_id == *shard)
                        .into_iter()
                        .map(|instance| {
                            shared.removed(&instance);
                            instance.signals
                        })
                        .collect();
                    metrics::set_for_type(
                        metrics::ENTITIES,
                        shared.entity_type.as_str(),
                        shared.resident(),
                    );
                    stopped
                };
                if stopped.is_empty() {
                    return;
                }
                tracing::debug!(entity_type = %shared.entity_type, %shard, instances = stopped.len(), force, "stopping the shard's entities");
                for signals in &stopped {
                    signals.stopping.cancel();
                    if force {
                        signals.interrupt.cancel();
                    }
                }
                let ended = futures_util::future::join_all(
                    stopped.iter().map(|signals| signals.ended.cancelled()),
                );
                if tokio::time::timeout(termination_timeout, ended).await.is_err() {
                    tracing::debug!(entity_type = %shared.entity_type, %shard, "termination timeout: interrupting");
                    for signals in &stopped {
                        signals.interrupt.cancel();
                    }
                    futures_util::future::join_all(
                        stopped.iter().map(|signals| signals.ended.cancelled()),
                    )
                    .await;
                }
            }
        })
    }

    fn has_instances_in(&self, shard: &ShardId) -> bool {
        self.shared.instances.partition(shard).any(|instance| instance.address.shard_id == *shard)
    }

    fn shutdown(&self, termination_timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let shared = &self.shared;
            shared.stopping.cancel();
            // Dropping the mailboxes' senders ends each instance once its queue is done.
            shared.instances.clear();
            shared.passivating.store(0, Ordering::Release);
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

impl<E: Entity> Passivate for Shared<E> {
    fn idle_instances(&self, manager: usize, out: &mut Vec<Candidate>) {
        self.instances.for_each(|instance| {
            let idle = instance.active.is_empty()
                && !instance.keep_alive.is_enabled()
                && !instance.active.passivating.load(Ordering::Acquire);
            if idle {
                out.push(Candidate {
                    last_used: instance.last_used,
                    shard: instance.address.shard_id.clone(),
                    id: instance.address.entity_id.clone(),
                    manager,
                });
            }
        });
    }

    fn passivate(&self, candidate: &Candidate, residency: &Residency) -> bool {
        let instances = self.instances.partition(&candidate.shard);
        let Some(instance) = instances.get(&candidate.id) else {
            return false;
        };
        // Still idle and not used since it was picked; admission clears the flag under this
        // lock, so the two cannot cross.
        let idle = instance.last_used == candidate.last_used
            && instance.active.is_empty()
            && !instance.keep_alive.is_enabled()
            && !instance.active.passivating.load(Ordering::Acquire);
        if !idle {
            return false;
        }
        instance.active.passivating.store(true, Ordering::Release);
        self.passivating.fetch_add(1, Ordering::AcqRel);
        residency.passivated();
        instance.active.passivate.notify_one();
        metrics::set_for_type(metrics::ENTITIES, self.entity_type.as_str(), self.resident());
        metrics::passivated(self.entity_type.as_str(), metrics::Passivation::Capacity);
        tracing::debug!(entity_type = %self.entity_type, entity_id = %candidate.id, "passivating to make room");
        true
    }
}

impl<E: Entity> Shared<E> {
    fn spawn(shared: &Arc<Shared<E>>, address: EntityAddress) -> Instance {
        let capacity =
            shared.options.mailbox_capacity.limit().map_or(MAILBOX_CHANNEL_MAX, |limit| {
                usize::try_from(limit.get()).unwrap_or(MAILBOX_CHANNEL_MAX).min(MAILBOX_CHANNEL_MAX)
            });
        let (mailbox, receiver) = mpsc::channel(capacity);
        let gauge = shared.options.mailbox_metrics.then(|| {
            let shard = address.shard_id.to_string();
            crate::metrics::mailbox_gauge(
                shared.entity_type.as_str(),
                address.entity_id.as_str(),
                &shard,
            )
        });
        let active = Arc::new(Active::reporting(gauge));
        let keep_alive = Arc::new(KeepAlive::default());
        // A root span: the instance outlives the request that created it, whose span (and
        // trace) it must not hold open.
        let span = tracing::debug_span!(
            parent: None,
            "entity",
            entity_type = %shared.entity_type,
            entity_id = %address.entity_id,
            shard = %address.shard_id,
        );
        let address_for_instance = address.clone();
        let signals = Signals {
            stopping: shared.stopping.token().child_token(),
            interrupt: shared.closed.child_token(),
            ended: CancellationToken::new(),
        };
        let handle = KeepAliveHandle {
            latch: Arc::clone(&keep_alive),
            send: Arc::clone(&shared.keep_alive_sender),
        };
        let task = run_instance(
            Arc::clone(shared),
            address,
            receiver,
            Arc::clone(&active),
            handle,
            signals.clone(),
        );
        shared.tasks.spawn(task.instrument(span));
        Instance {
            address: address_for_instance,
            signals,
            mailbox,
            active,
            keep_alive,
            last_used: Snowflake::new(0),
        }
    }

    /// Whether the type holds as many instances as [`ManagerOptions::max_resident`] allows,
    /// not counting those passivating.
    fn type_is_full(&self) -> bool {
        self.options.max_resident.is_full(self.resident())
    }

    /// The instances of the type that count as resident: those in `instances` that are not
    /// passivating (they only finish their `on_stop`).
    fn resident(&self) -> usize {
        self.instances.len().saturating_sub(self.passivating.load(Ordering::Acquire))
    }

    /// Passivates up to a batch of the type's least recently used idle instances.
    fn make_room_in_type(self: &Arc<Self>) {
        let mut quiet = lock(&self.quiet);
        if self.type_is_full() && !quiet.holds() {
            let this: Arc<dyn Passivate> = self.clone();
            let batch = room_batch(self.options.max_resident);
            quiet.after(passivate_least_recent(&[this], batch, &self.residency));
        }
    }

    /// A passivating instance got a request.
    fn revive(&self) {
        self.passivating.fetch_sub(1, Ordering::AcqRel);
        self.residency.revived();
    }

    /// An instance left `instances` (under its partition's lock).
    fn removed(&self, instance: &Instance) {
        if instance.active.passivating.load(Ordering::Acquire) {
            self.passivating.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The instance's task ends: its slot is given back, unless it was given back when it
    /// started passivating.
    fn leave(&self, active: &Active) {
        if active.passivating.swap(false, Ordering::AcqRel) {
            self.residency.passivation_ended();
        } else {
            self.residency.release();
        }
    }

    /// Whether requests tagged `tag` run on a shared reference.
    fn is_shared(&self, tag: &str) -> bool {
        self.protocol.get(tag).is_some_and(|entry| matches!(entry.call, CallKind::Shared(_)))
    }

    /// Whether requests tagged `tag` run forked.
    fn is_forked(&self, tag: &str) -> bool {
        self.protocol.get(tag).is_some_and(|entry| entry.call.is_forked())
    }

    /// Whether the instance is idle: nothing running, nothing queued, no keep-alive.
    fn is_idle(&self, address: &EntityAddress, receiver: &mpsc::Receiver<Box<Delivery>>) -> bool {
        Self::idle_in(&self.instances.partition(&address.shard_id), address, receiver)
    }

    fn idle_in(
        instances: &Partition<'_, Instance>,
        address: &EntityAddress,
        receiver: &mpsc::Receiver<Box<Delivery>>,
    ) -> bool {
        instances
            .get(&address.entity_id)
            .is_some_and(|instance| instance.active.is_empty() && !instance.keep_alive.is_enabled())
            && receiver.is_empty()
    }

    /// Removes the instance if it is idle. Under the lock, so no request can be admitted in
    /// between.
    fn retire(&self, address: &EntityAddress, receiver: &mpsc::Receiver<Box<Delivery>>) -> bool {
        let mut instances = self.instances.partition(&address.shard_id);
        let idle = Self::idle_in(&instances, address, receiver);
        if idle {
            if let Some(instance) = instances.remove(&address.entity_id) {
                self.removed(&instance);
            }
            metrics::set_for_type(metrics::ENTITIES, self.entity_type.as_str(), self.resident());
        }
        idle
    }

    async fn backoff(&self, interrupt: &CancellationToken) {
        let delay = lock(&self.restarts).next(tokio::time::Instant::now());
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = interrupt.cancelled() => {}
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
    /// Stopped because another request of the instance panicked: replayed after the restart.
    Restarted,
}

/// The entity value a run works on.
enum Access<E> {
    /// The value itself, for a `&mut self` handler.
    Exclusive(E),
    /// A share of it, for a `&self` handler.
    Shared(SharedValue),
    /// The forked state of the request's type, for a forked handler.
    Forked(SharedValue),
}

/// Where the instance's entity value is between runs.
enum Slot<E> {
    /// With the instance loop, free for any run.
    Idle(E),
    /// Moved into the running exclusive request.
    Lent,
    /// Shared by the running shared requests.
    Shared(SharedValue),
    /// None: the manager closed while the instance restarted.
    Gone,
}

impl<E: Entity> Slot<E> {
    /// The value for an exclusive run; `None` unless every share came back.
    fn take_exclusive(&mut self, sharing: Option<&Sharing<E>>) -> Option<E> {
        match std::mem::replace(self, Slot::Lent) {
            Slot::Idle(entity) => Some(entity),
            Slot::Shared(entity) => match sharing.map(|sharing| (sharing.unshare)(entity)) {
                Some(Ok(entity)) => Some(entity),
                Some(Err(entity)) => {
                    *self = Slot::Shared(entity);
                    None
                }
                None => None,
            },
            other => {
                *self = other;
                None
            }
        }
    }

    /// A share of the value for a shared run; `None` while an exclusive run has it.
    fn take_shared(&mut self, sharing: &Sharing<E>) -> Option<SharedValue> {
        match std::mem::replace(self, Slot::Gone) {
            Slot::Idle(entity) => {
                let entity = (sharing.share)(entity);
                *self = Slot::Shared(Arc::clone(&entity));
                Some(entity)
            }
            Slot::Shared(entity) => {
                *self = Slot::Shared(Arc::clone(&entity));
                Some(entity)
            }
            other => {
                *self = other;
                None
            }
        }
    }

    /// Takes back what a run worked on.
    fn give_back(&mut self, access: Access<E>) {
        match access {
            Access::Exclusive(entity) => *self = Slot::Idle(entity),
            // The slot keeps its own share; the instance keeps the forked states.
            Access::Shared(entity) | Access::Forked(entity) => drop(entity),
        }
    }
}

/// One finished run.
struct Finished<E> {
    /// The delivery's position in the instance's delivery order.
    seq: u64,
    delivery: Box<Delivery>,
    access: Access<E>,
    outcome: Outcome,
}

/// A delivery waiting to start, with its position in delivery order.
struct Queued {
    seq: u64,
    /// Boxed as it came through the mailbox: it moves from the queue into the run and back
    /// into [`Finished`] as a pointer.
    delivery: Box<Delivery>,
}

/// One resident instance: its entity value, its requests waiting to start (in delivery
/// order) and its shared requests running.
///
/// Requests start in delivery order. An exclusive (`&mut self`) request starts when nothing
/// else runs and runs alone, inline; a shared (`&self`) one starts when no exclusive request
/// runs and fewer than `concurrency` shared ones do. A forked request starts when it arrives
/// and runs beside all of them, outside the queue and the cap. A panic cancels the other running
/// requests, recreates the entity after the type's backoff, and replays them all in delivery
/// order (the reference's defect restart of a handler generation).
struct InstanceLoop<E: Entity> {
    shared: Arc<Shared<E>>,
    address: EntityAddress,
    receiver: mpsc::Receiver<Box<Delivery>>,
    active: Arc<Active>,
    keep_alive: KeepAliveHandle,
    slot: Slot<E>,
    /// Fired when the entity restarts after a panic: the running requests stop.
    generation: InterruptSignal,
    queue: VecDeque<Queued>,
    running: FuturesUnordered<BoxFuture<'static, Finished<E>>>,
    /// The forked requests running: beside everything else, not counted against the
    /// concurrency cap.
    forked: FuturesUnordered<BoxFuture<'static, Finished<E>>>,
    /// The forked states of the entity value, by request tag, taken when it was created.
    forks: BTreeMap<&'static str, SharedValue>,
    /// What the instance knows of its stored state (entity types with durable state).
    state: Option<StateCell>,
    next_seq: u64,
    mailbox_open: bool,
    /// Shared with the shared requests' runs (one reference count, not a clone of each token).
    signals: Arc<Signals>,
    /// The idle timer, registered once and moved forward only when it fires (a timer per
    /// request would cost a timer-wheel insertion and removal on every delivery).
    idle_timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

async fn run_instance<E: Entity>(
    shared: Arc<Shared<E>>,
    address: EntityAddress,
    receiver: mpsc::Receiver<Box<Delivery>>,
    active: Arc<Active>,
    keep_alive: KeepAliveHandle,
    signals: Signals,
) {
    // Whatever way the task ends, waiters on the instance hear of it.
    let _ended = signals.ended.clone().drop_guard();
    // The rare steps (creating, stopping, restarting) are boxed: inline, the largest of them
    // (the entity's own `create` among them) would size every resident instance's task.
    let Some((entity, state)) = Box::pin(activate(&shared, &address, &signals.interrupt)).await
    else {
        keep_alive.latch.abandon();
        shared.leave(&active);
        return;
    };
    let forks = shared.protocol.fork_states(&entity);
    let mut instance = InstanceLoop {
        shared,
        address,
        receiver,
        active,
        keep_alive,
        slot: Slot::Idle(entity),
        generation: InterruptSignal::new(),
        queue: VecDeque::new(),
        running: FuturesUnordered::new(),
        forked: FuturesUnordered::new(),
        forks,
        state,
        next_seq: 0,
        mailbox_open: true,
        signals: Arc::new(signals),
        idle_timer: None,
    };
    loop {
        instance.run().await;
        Box::pin(instance.stop()).await;
        // Idle (not stopped by shutdown): leave, unless requests came in while `on_stop` ran;
        // those get a new value, so that one id never has two live values.
        if !instance.mailbox_open
            || instance.shared.retire(&instance.address, &instance.receiver)
            || !instance.recreate().await
        {
            break;
        }
    }
    instance.keep_alive.latch.abandon();
    instance.shared.leave(&instance.active);
}

impl<E: Entity> InstanceLoop<E> {
    async fn run(&mut self) {
        loop {
            if let Some(head) = self.queue.front() {
                let tag = &head.delivery.request.tag;
                let (is_shared, is_forked) =
                    (self.shared.is_shared(tag), self.shared.is_forked(tag));
                if self.signals.interrupt.is_cancelled() && head.delivery.started.is_some() {
                    // The instance was cut off (the end of a drain, a lost lock) before this
                    // persisted request started: it is left stored, unanswered, for the next
                    // run. An interrupt stored as its reply would end it for good once the
                    // shard is served again.
                    if let Some(queued) = self.queue.pop_front() {
                        self.leave_stored(queued.delivery);
                    }
                } else if matches!(self.slot, Slot::Gone) {
                    // The manager closed during a restart: everything left is interrupted.
                    if let Some(queued) = self.queue.pop_front() {
                        self.respond(queued.delivery, Exit::interrupt()).await;
                    }
                } else if is_forked {
                    // Replayed after a restart.
                    if let Some(queued) = self.queue.pop_front() {
                        self.start_forked(queued).await;
                    }
                } else if is_shared && !self.shared.options.concurrency.is_full(self.running.len())
                {
                    self.start_shared().await;
                } else if !is_shared && self.running.is_empty() {
                    self.run_exclusive().await;
                } else if self.forked.is_empty() {
                    if let Some(finished) = self.running.next().await {
                        // The head waits for a running request to finish.
                        self.settle(finished).await;
                    }
                } else {
                    // The head waits for a running request; forked ones finish meanwhile.
                    tokio::select! {
                        biased;
                        Some(finished) = self.running.next() => self.settle(finished).await,
                        Some(finished) = self.forked.next() => self.settle(finished).await,
                    }
                }
                continue;
            }
            if self.running.is_empty() && self.forked.is_empty() {
                if !self.mailbox_open {
                    return;
                }
                let next = next_delivery(
                    &self.shared,
                    &self.address,
                    &mut self.receiver,
                    &self.active,
                    &mut self.idle_timer,
                );
                match next.await {
                    Next::Delivery(delivery) => self.enqueue(delivery).await,
                    Next::Idle => return,
                    Next::Closed => {
                        self.mailbox_open = false;
                        return;
                    }
                }
                continue;
            }
            tokio::select! {
                biased;
                Some(finished) = self.running.next() => self.settle(finished).await,
                Some(finished) = self.forked.next() => self.settle(finished).await,
                delivery = self.receiver.recv(), if self.mailbox_open => match delivery {
                    Some(delivery) => self.enqueue(delivery).await,
                    None => self.mailbox_open = false,
                },
            }
        }
    }

    /// Runs the entity's `on_stop` on its value, within the type's `on_stop_timeout`. Not
    /// after a panic that left no value (the manager closed during the restart).
    async fn stop(&mut self) {
        let entity = match std::mem::replace(&mut self.slot, Slot::Gone) {
            Slot::Idle(entity) => Some(entity),
            Slot::Shared(entity) => {
                self.shared.protocol.sharing().and_then(|sharing| (sharing.unshare)(entity).ok())
            }
            Slot::Lent | Slot::Gone => None,
        };
        let Some(mut entity) = entity else { return };
        // Called inside the guard: a hand-written `on_stop` may panic before its future exists.
        let stopping = cluster_core::future::guarded(|| entity.on_stop());
        match tokio::time::timeout(self.shared.options.on_stop_timeout, stopping).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                tracing::warn!(entity_type = %self.shared.entity_type, entity_id = %self.address.entity_id, "defect in on_stop");
            }
            Err(_) => {
                tracing::warn!(entity_type = %self.shared.entity_type, entity_id = %self.address.entity_id, timeout = ?self.shared.options.on_stop_timeout, "on_stop timed out");
            }
        }
    }

    /// A new value after `on_stop`, for requests that arrived meanwhile; `false` once the
    /// manager closed.
    async fn recreate(&mut self) -> bool {
        match Box::pin(activate(&self.shared, &self.address, &self.signals.interrupt)).await {
            Some((entity, state)) => {
                self.install(entity, state);
                true
            }
            None => false,
        }
    }

    /// Queues a delivery; a forked one starts at once instead.
    async fn enqueue(&mut self, delivery: Box<Delivery>) {
        let queued = Queued { seq: self.next_seq, delivery };
        self.next_seq += 1;
        if self.shared.is_forked(&queued.delivery.request.tag) && !matches!(self.slot, Slot::Gone) {
            self.start_forked(queued).await;
        } else {
            self.queue.push_back(queued);
        }
    }

    /// Puts a new entity value in the slot, with what it knows of its stored state, and takes
    /// its forked states.
    fn install(&mut self, entity: E, state: Option<StateCell>) {
        self.forks = self.shared.protocol.fork_states(&entity);
        self.slot = Slot::Idle(entity);
        self.state = state;
    }

    /// Starts a forked request beside everything else.
    async fn start_forked(&mut self, queued: Queued) {
        let started = spawn_forked(
            &self.shared,
            &self.forks,
            &self.generation,
            &self.signals,
            &self.keep_alive,
            &mut self.forked,
            queued,
        );
        if let Err(queued) = started {
            self.respond(queued.delivery, malformed("no forked state for this request")).await;
        }
    }

    /// Runs the head of the queue, an exclusive request, to its end.
    async fn run_exclusive(&mut self) {
        let Some(queued) = self.queue.pop_front() else { return };
        let Some(entity) = self.slot.take_exclusive(self.shared.protocol.sharing()) else {
            // Cannot happen: every share comes back with its run. Start afresh rather than
            // wait forever.
            tracing::error!(entity_type = %self.shared.entity_type, entity_id = %self.address.entity_id, "entity value still shared; restarting");
            self.queue.push_front(queued);
            Box::pin(self.restart(Vec::new())).await;
            return;
        };
        // On borrowed signals: nothing is cloned for an exclusive run.
        let run = run_one(
            &self.shared,
            Access::Exclusive(entity),
            queued,
            self.keep_alive.clone(),
            &self.generation,
            &self.signals,
        );
        if !self.shared.protocol.has_forked() {
            let finished = run.await;
            return self.settle(finished).await;
        }
        // Forked requests run beside it: the ones running go on, new ones start as they
        // arrive, and the others wait in the queue. A forked run that panicked is settled (the
        // restart) once the exclusive run is over.
        let mut panicked = Vec::new();
        let mut run = Box::pin(run);
        let finished = loop {
            tokio::select! {
                biased;
                finished = &mut run => break finished,
                Some(done) = self.forked.next() => match done.outcome {
                    Outcome::Exited(exit) => {
                        respond_to(&self.shared, &self.active, done.delivery, exit).await;
                    }
                    Outcome::Panicked | Outcome::Restarted => panicked.push(done),
                },
                delivery = self.receiver.recv(), if self.mailbox_open => {
                    let Some(delivery) = delivery else {
                        self.mailbox_open = false;
                        continue;
                    };
                    let queued = Queued { seq: self.next_seq, delivery };
                    self.next_seq += 1;
                    if !self.shared.is_forked(&queued.delivery.request.tag) {
                        self.queue.push_back(queued);
                        continue;
                    }
                    let started = spawn_forked(
                        &self.shared,
                        &self.forks,
                        &self.generation,
                        &self.signals,
                        &self.keep_alive,
                        &mut self.forked,
                        queued,
                    );
                    if let Err(queued) = started {
                        let exit = malformed("no forked state for this request");
                        respond_to(&self.shared, &self.active, queued.delivery, exit).await;
                    }
                }
            }
        };
        drop(run);
        self.settle(finished).await;
        for done in panicked {
            self.settle(done).await;
        }
    }

    /// Starts the head of the queue, a shared request, alongside the running ones.
    async fn start_shared(&mut self) {
        let Some(queued) = self.queue.pop_front() else { return };
        let sharing = self.shared.protocol.sharing();
        let Some(entity) = sharing.and_then(|sharing| self.slot.take_shared(sharing)) else {
            // Cannot happen: a shared request type makes the protocol shareable, and the value
            // is with the loop whenever a request starts.
            self.respond(queued.delivery, malformed("the entity value cannot be shared")).await;
            return;
        };
        // Runs beside the loop: it owns what it borrows.
        let (shared, generation, signals) =
            (Arc::clone(&self.shared), self.generation.clone(), Arc::clone(&self.signals));
        let keep_alive = self.keep_alive.clone();
        self.running.push(Box::pin(async move {
            run_one(&shared, Access::Shared(entity), queued, keep_alive, &generation, &signals)
                .await
        }));
    }

    /// Answers a finished run, or restarts the entity after a panic.
    async fn settle(&mut self, finished: Finished<E>) {
        match finished.outcome {
            Outcome::Exited(exit) => match finished.access {
                Access::Exclusive(entity) if self.state.is_some() => {
                    Box::pin(self.settle_durable(entity, finished.delivery, exit)).await;
                }
                access => {
                    self.slot.give_back(access);
                    self.respond(finished.delivery, exit).await;
                }
            },
            Outcome::Panicked | Outcome::Restarted => {
                tracing::warn!(entity_type = %self.shared.entity_type, entity_id = %self.address.entity_id, "defect in entity, restarting");
                let mut replay = Vec::new();
                self.answer_or_replay(finished, &mut replay).await;
                Box::pin(self.restart(replay)).await;
            }
        }
    }

    /// A run that panicked ends with a defect at once ([`Defects::Answer`]) or is queued in
    /// `replay` to run again on the recreated instance; a run stopped by another's panic is
    /// always replayed.
    ///
    /// [`Defects::Answer`]: crate::api::entity::Defects::Answer
    async fn answer_or_replay(&mut self, finished: Finished<E>, replay: &mut Vec<Queued>) {
        let answered = matches!(finished.outcome, Outcome::Panicked)
            && self.shared.options.defects == crate::api::entity::Defects::Answer;
        if answered {
            let exit = Exit::die_with_message("Defect", "the handler panicked");
            self.respond(finished.delivery, exit).await;
        } else {
            replay.push(Queued { seq: finished.seq, delivery: finished.delivery });
        }
    }

    /// Stops the running requests, recreates the entity after the type's backoff and queues
    /// `replay` and the stopped requests again, in delivery order, ahead of the rest.
    async fn restart(&mut self, mut replay: Vec<Queued>) {
        self.generation.cancel();
        let mut stopped = std::mem::take(&mut self.running);
        stopped.extend(std::mem::take(&mut self.forked));
        while let Some(finished) = stopped.next().await {
            match finished.outcome {
                // Finished just before the restart reached it.
                Outcome::Exited(exit) => self.respond(finished.delivery, exit).await,
                Outcome::Panicked | Outcome::Restarted => {
                    self.answer_or_replay(finished, &mut replay).await;
                }
            }
        }
        replay.sort_by_key(|queued| queued.seq);
        for queued in replay.into_iter().rev() {
            self.queue.push_front(queued);
        }
        self.slot = Slot::Gone;
        self.shared.backoff(&self.signals.interrupt).await;
        if let Some((entity, state)) =
            activate(&self.shared, &self.address, &self.signals.interrupt).await
        {
            self.install(entity, state);
            self.generation = InterruptSignal::new();
        }
    }

    /// Answers an exclusive run of an entity with durable state, and commits its state change
    /// first (volatile) or with its final reply (persisted): see [`crate::api::state`].
    async fn settle_durable(&mut self, mut entity: E, mut delivery: Box<Delivery>, mut exit: Exit) {
        let (Some(durability), Some(cell)) = (self.shared.protocol.durability(), &self.state)
        else {
            self.slot.give_back(Access::Exclusive(entity));
            return self.respond(delivery, exit).await;
        };
        let change = match durability.encode(&mut entity) {
            Ok(current) if exit.is_success() => cell.after(&self.address, current),
            // A failed request changes nothing.
            Ok(current) => match cell.after(&self.address, current) {
                Change::Unchanged => Change::Unchanged,
                Change::Initial(_) | Change::Write(..) => {
                    self.revert(&mut entity);
                    Change::Unchanged
                }
            },
            Err(error) => {
                tracing::warn!(%error, entity_type = %self.shared.entity_type, entity_id = %self.address.entity_id, "the entity state cannot be encoded; the request fails and the state stays");
                self.revert(&mut entity);
                let message = format!("the entity state cannot be encoded: {error}");
                exit = Exit::die_with_message("StateNotEncoded", &message);
                Change::Unchanged
            }
        };
        let (write, current) = match change {
            Change::Unchanged => {
                self.slot.give_back(Access::Exclusive(entity));
                return self.respond(delivery, exit).await;
            }
            Change::Initial(current) => {
                if let Some(cell) = &mut self.state {
                    cell.back_to_initial(current);
                }
                self.slot.give_back(Access::Exclusive(entity));
                return self.respond(delivery, exit).await;
            }
            Change::Write(write, current) => (write, current),
        };
        if matches!(delivery.reply, ReplyTo::Stream(_)) {
            self.revert(&mut entity);
            self.slot.give_back(Access::Exclusive(entity));
            let message = "a streaming handler changed the entity's durable state: streaming \
                           handlers may read it, not change it (the change is dropped)";
            return self
                .respond(delivery, Exit::die_with_message("StateChangedByStream", message))
                .await;
        }
        let committed = match delivery.state.take() {
            // Persisted: committed with the final reply by the task that stores it.
            Some(sink) => {
                let (committed, outcome) = tokio::sync::oneshot::channel();
                let handoff = StateHandOff { write: write.clone(), committed };
                let _ = sink.send(handoff);
                self.respond(delivery, exit).await;
                outcome.await.unwrap_or(Committed::No)
            }
            // Volatile: committed before the reply is sent.
            None => {
                let saved = match &self.shared.state_storage {
                    Some(storage) => storage.save_state(&write).await,
                    None => Err(cluster_core::entity_state::unsupported("runtime's")),
                };
                match saved {
                    Ok(()) => {
                        self.respond(delivery, exit).await;
                        Committed::Yes
                    }
                    Err(error) => {
                        tracing::warn!(%error, entity_type = %self.shared.entity_type, entity_id = %self.address.entity_id, "the entity state could not be saved; the request fails");
                        let message = format!("the entity state could not be saved: {error}");
                        self.respond(delivery, Exit::die_with_message("StateNotSaved", &message))
                            .await;
                        Committed::No
                    }
                }
            }
        };
        match committed {
            Committed::Yes => {
                if let Some(cell) = &mut self.state {
                    cell.committed_as(&write, current);
                }
            }
            Committed::No => Box::pin(self.reload(&mut entity)).await,
        }
        self.slot.give_back(Access::Exclusive(entity));
    }

    /// Drops a persisted request that never started, unanswered: the task that stores its
    /// outcome finds no exit and leaves it stored for the next run.
    fn leave_stored(&self, delivery: Box<Delivery>) {
        tracing::debug!(request_id = %delivery.request.request_id, "instance cut off: the request is left stored");
        self.active.finish(delivery.request.request_id);
    }

    /// Gives `entity` its committed state back (after a request that failed).
    fn revert(&self, entity: &mut E) {
        let (Some(durability), Some(cell)) = (self.shared.protocol.durability(), &self.state)
        else {
            return;
        };
        if let Err(error) = durability.decode(entity, cell.committed()) {
            tracing::error!(%error, entity_type = %self.shared.entity_type, entity_id = %self.address.entity_id, "the committed entity state does not decode back");
        }
    }

    /// Reads the stored state again after a write that did not commit (or whose outcome is
    /// unknown), and puts it in `entity`. Until the instance is interrupted: then the value
    /// gets the state committed here last.
    async fn reload(&mut self, entity: &mut E) {
        let loaded = load_state(&self.shared, &self.address, entity, &self.signals.interrupt).await;
        if let (Some(stored), Some(cell)) = (loaded, &mut self.state) {
            cell.reloaded(stored);
        }
        // Without a row, the value still holds the state of the write that did not commit: it
        // gets the initial one (the committed state now).
        self.revert(entity);
    }

    /// Sends a request's exit to where it goes; the caller may have gone away (an interrupted
    /// request).
    async fn respond(&mut self, delivery: Box<Delivery>, exit: Exit) {
        respond_to(&self.shared, &self.active, delivery, exit).await;
    }
}

/// Sends a request's exit to where it goes and lets the request leave the instance's mailbox;
/// the caller may have gone away (an interrupted request).
async fn respond_to<E: Entity>(
    shared: &Shared<E>,
    active: &Active,
    delivery: Box<Delivery>,
    exit: Exit,
) {
    let request_id = delivery.request.request_id;
    if let Some(entry) = shared.protocol.get(&delivery.request.tag) {
        entry.metrics.exited(delivery.kind(), &exit);
    }
    match delivery.reply {
        ReplyTo::Exit(reply) => {
            let _ = reply.send(exit);
        }
        ReplyTo::Stream(stream) => {
            let with_exit =
                WithExit { request_id: delivery.request.request_id, id: shared.ids.next(), exit };
            let _ = stream.replies.send(Reply::WithExit(with_exit)).await;
        }
    }
    active.finish(request_id);
}

/// Starts a forked request in `forked`, on the forked state of its type; gives it back when
/// the instance has no such state (cannot happen: a forked request type has one).
fn spawn_forked<E: Entity>(
    shared: &Arc<Shared<E>>,
    forks: &BTreeMap<&'static str, SharedValue>,
    generation: &InterruptSignal,
    signals: &Arc<Signals>,
    keep_alive: &KeepAliveHandle,
    forked: &mut FuturesUnordered<BoxFuture<'static, Finished<E>>>,
    queued: Queued,
) -> Result<(), Queued> {
    let Some(state) = forks.get(&*queued.delivery.request.tag) else { return Err(queued) };
    let access = Access::Forked(Arc::clone(state));
    let (shared, generation, signals) =
        (Arc::clone(shared), generation.clone(), Arc::clone(signals));
    let keep_alive = keep_alive.clone();
    tracing::trace!(entity_type = %shared.entity_type, request_id = %queued.delivery.request.request_id, "forked");
    forked.push(Box::pin(async move {
        run_one(&shared, access, queued, keep_alive, &generation, &signals).await
    }));
    Ok(())
}

/// Creates the instance and loads its durable state into it, if the type declared one;
/// `None` once the manager closed (or the runtime is gone).
async fn activate<E: Entity>(
    shared: &Shared<E>,
    address: &EntityAddress,
    interrupt: &CancellationToken,
) -> Option<(E, Option<StateCell>)> {
    loop {
        let mut entity = create(shared, address, interrupt).await?;
        let Some(durability) = shared.protocol.durability() else {
            return Some((entity, None));
        };
        let initial = match durability.encode(&mut entity) {
            Ok(initial) => initial,
            Err(error) => {
                tracing::error!(%error, entity_type = %shared.entity_type, entity_id = %address.entity_id, "the state of a new entity value cannot be encoded; creating it again");
                shared.backoff(interrupt).await;
                continue;
            }
        };
        let stored = load_state(shared, address, &mut entity, interrupt).await?;
        return Some((entity, Some(StateCell::new(initial, stored))));
    }
}

/// Reads the entity's stored state and puts it in `entity`, retrying with the type's backoff
/// while the storage fails or the row does not decode (it is left as it is, for an operator or
/// a deploy to fix); `None` once interrupted. Without a row, `entity` is left as it is.
async fn load_state<E: Entity>(
    shared: &Shared<E>,
    address: &EntityAddress,
    entity: &mut E,
    interrupt: &CancellationToken,
) -> Option<Option<StoredState>> {
    let (Some(durability), Some(storage)) =
        (shared.protocol.durability(), shared.state_storage.as_ref())
    else {
        return Some(None);
    };
    loop {
        if interrupt.is_cancelled() {
            return None;
        }
        match storage.load_state(address).await {
            Ok(stored) => {
                let decoded = match &stored {
                    Some(row) => durability.decode(entity, &row.value),
                    None => Ok(()),
                };
                match decoded {
                    Ok(()) => return Some(stored),
                    Err(error) => {
                        tracing::error!(%error, entity_type = %shared.entity_type, entity_id = %address.entity_id, "the stored entity state does not decode; its requests wait (fix the row or deploy code that reads it)");
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, entity_type = %shared.entity_type, entity_id = %address.entity_id, "could not load the entity state; retrying");
            }
        }
        shared.backoff(interrupt).await;
    }
}

/// Creates the instance with the type's factory, retrying with backoff if it panics; `None`
/// once the manager closed (or the runtime is gone).
async fn create<E: Entity>(
    shared: &Shared<E>,
    address: &EntityAddress,
    interrupt: &CancellationToken,
) -> Option<E> {
    loop {
        if interrupt.is_cancelled() {
            return None;
        }
        let context = (shared.contexts)(address)?;
        match AssertUnwindSafe(shared.factory.make(&context)).catch_unwind().await {
            Ok(entity) => return Some(entity),
            Err(_) => {
                tracing::warn!(entity_type = %shared.entity_type, entity_id = %address.entity_id, "defect creating entity, retrying");
                shared.backoff(interrupt).await;
            }
        }
    }
}

/// What the instance loop waits for when nothing runs.
enum Next {
    Delivery(Box<Delivery>),
    /// Nothing came for `max_idle_time` and the instance is idle: it may be reaped.
    Idle,
    /// The mailbox closed: the manager stops.
    Closed,
}

/// The next request, or why there is none: [`Next::Idle`] once nothing came for
/// `max_idle_time` from this call on and the instance is idle.
///
/// `timer` is the instance's idle timer. It fires at the latest when this wait is due, and
/// is moved forward to the due time when it fires earlier (it was set by an earlier wait).
async fn next_delivery<E: Entity>(
    shared: &Shared<E>,
    address: &EntityAddress,
    receiver: &mut mpsc::Receiver<Box<Delivery>>,
    active: &Active,
    timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
) -> Next {
    let received = |delivery: Option<Box<Delivery>>| delivery.map_or(Next::Closed, Next::Delivery);
    // Told to passivate, and still idle: the flag is cleared by a request that came since.
    let passivating = |receiver: &mpsc::Receiver<Box<Delivery>>| {
        active.passivating.load(Ordering::Acquire) && shared.is_idle(address, receiver)
    };
    // Without an idle time there is no timer, and the instance waits for a request or to be
    // told to passivate.
    let idle = shared.options.max_idle_time;
    let mut due = idle.map(crate::time::deadline);
    if let Some(due) = due {
        timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
    }
    loop {
        let fired = async {
            match timer.as_mut() {
                Some(timer) => timer.as_mut().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            delivery = receiver.recv() => return received(delivery),
            () = active.passivate.notified() => {
                if passivating(receiver) {
                    return Next::Idle;
                }
            }
            () = fired => {
                let (Some(idle), Some(at), Some(timer)) = (idle, due, timer.as_mut()) else {
                    continue;
                };
                let now = tokio::time::Instant::now();
                if now < at {
                    timer.as_mut().reset(at);
                } else if shared.is_idle(address, receiver) {
                    metrics::passivated(shared.entity_type.as_str(), metrics::Passivation::Idle);
                    return Next::Idle;
                } else {
                    // Something holds the instance (a keep-alive): wait another period.
                    let next = crate::time::after(now, idle);
                    due = Some(next);
                    timer.as_mut().reset(next);
                }
            }
        }
    }
}

/// Runs one request on `access` and hands everything back with the outcome.
async fn run_one<E: Entity>(
    shared: &Shared<E>,
    mut access: Access<E>,
    queued: Queued,
    keep_alive: KeepAliveHandle,
    generation: &InterruptSignal,
    signals: &Signals,
) -> Finished<E> {
    let Queued { seq, mut delivery } = queued;
    let outcome = handle(shared, &mut access, &mut delivery, keep_alive, generation, signals).await;
    Finished { seq, delivery, access, outcome }
}

/// The `request` span of one handler run, continuing the trace the request carries.
fn request_span(request: &Request) -> tracing::Span {
    let address = &request.address;
    let span = tracing::debug_span!(
        "request",
        entity_type = %address.entity_type,
        entity_id = %address.entity_id,
        shard = %address.shard_id,
        request_id = %request.request_id,
        tag = %request.tag,
    );
    crate::trace::set_parent(&span, &request.trace);
    span
}

async fn handle<E: Entity>(
    shared: &Shared<E>,
    access: &mut Access<E>,
    delivery: &mut Delivery,
    keep_alive: KeepAliveHandle,
    generation: &InterruptSignal,
    signals: &Signals,
) -> Outcome {
    let request = &delivery.request;
    let address = &request.address;
    let Some(entry) = shared.protocol.get(&request.tag) else {
        let message =
            format!("entity type {} has no request {:?}", shared.entity_type, request.tag);
        return Outcome::Exited(malformed(&message));
    };
    if delivery.cancellation.is_cancelled()
        || signals.interrupt.is_cancelled()
        || (entry.interrupt_on_termination && signals.stopping.is_cancelled())
    {
        return Outcome::Exited(Exit::interrupt());
    }
    if generation.is_cancelled() {
        return Outcome::Restarted;
    }
    if let Some(transaction) = &delivery.transaction {
        let begun =
            begin_transaction(shared, transaction, &delivery.cancellation, signals, generation);
        if let Some(stopped) = Box::pin(begun).await {
            return stopped;
        }
    }
    if let Some(started) = &delivery.started {
        started.store(true, Ordering::Release);
    }
    let context = RequestContext::new(
        address.clone(),
        request.request_id,
        delivery.cancellation.clone(),
        delivery.transaction.as_ref().map(|transaction| Arc::clone(transaction.slot())),
        keep_alive,
        &request.headers,
    );
    let span = request_span(request);
    let mut channel = match (entry.call.is_stream(), &mut delivery.reply) {
        (true, ReplyTo::Stream(stream)) => Some(chunk_channel(shared, request, stream)),
        (true, ReplyTo::Exit(_)) => {
            return Outcome::Exited(malformed(
                "a streaming request was delivered without a stream",
            ));
        }
        (false, _) => None,
    };
    let call = match (&entry.call, access, channel.as_mut()) {
        (CallKind::Stream(call), Access::Exclusive(entity), Some(channel)) => {
            call(entity, &context, &request.payload, channel)
        }
        (CallKind::Unary(call), Access::Exclusive(entity), _) => {
            call(entity, &context, &request.payload)
        }
        (CallKind::Shared(call), Access::Exclusive(entity), _) => {
            call(entity, &context, &request.payload)
        }
        (CallKind::Shared(call), Access::Shared(entity), _) => match entity.downcast_ref::<E>() {
            Some(entity) => call(entity, &context, &request.payload),
            None => return Outcome::Exited(malformed("a shared entity value of another type")),
        },
        (CallKind::Forked(call), Access::Forked(state), _) => {
            call(state, &context, &request.payload)
        }
        (CallKind::ForkedStream(call), Access::Forked(state), Some(channel)) => {
            call(state, &context, &request.payload, channel)
        }
        _ => return Outcome::Exited(malformed("a request was dispatched in the wrong mode")),
    };
    // The handler is polled once on its own: one that finishes on its first poll (most do)
    // never builds the wait on the four interrupt sources, nor registers with them (which
    // costs a lock on each). The interruptions were checked just before it started.
    let began = tokio::time::Instant::now();
    let outcome = {
        let mut handled = std::pin::pin!(AssertUnwindSafe(call).catch_unwind().instrument(span));
        match futures_util::poll!(handled.as_mut()) {
            std::task::Poll::Ready(Ok(exit)) => Outcome::Exited(exit),
            std::task::Poll::Ready(Err(_)) => Outcome::Panicked,
            std::task::Poll::Pending => {
                let interrupt_on_termination = entry.interrupt_on_termination;
                let interrupted = &delivery.cancellation;
                Box::pin(until_interrupted(
                    handled,
                    interrupted,
                    signals,
                    generation,
                    interrupt_on_termination,
                ))
                .await
            }
        }
    };
    entry.metrics.handled(began.elapsed());
    // Give the stream's acknowledgements back, so that a restarted run continues the stream.
    if let (Some(channel), ReplyTo::Stream(stream)) = (channel, &mut delivery.reply) {
        stream.acks = channel.acks;
        stream.last_sent = channel.last_sent;
    }
    outcome
}

/// Begins the request's transaction, retrying after `transaction_retry` while the storage
/// fails, until it is begun (`None`) or the request is interrupted (its own interrupt, the
/// instance's interruption at the end of a drain, or a restart after a panic). Meanwhile the
/// request holds its place in the instance's order, as it would while its handler ran.
async fn begin_transaction<E: Entity>(
    shared: &Shared<E>,
    transaction: &PendingTransaction,
    interrupted: &InterruptSignal,
    signals: &Signals,
    generation: &InterruptSignal,
) -> Option<Outcome> {
    let interruption = async {
        tokio::select! {
            () = interrupted.cancelled() => Outcome::Exited(Exit::interrupt()),
            () = signals.interrupt.cancelled() => Outcome::Exited(Exit::interrupt()),
            () = generation.cancelled() => Outcome::Restarted,
        }
    };
    let mut interruption = std::pin::pin!(interruption);
    let mut attempt: u32 = 0;
    loop {
        attempt = attempt.saturating_add(1);
        let begun = tokio::select! {
            biased;
            outcome = interruption.as_mut() => return Some(outcome),
            begun = transaction.begin() => begun,
        };
        let Err(error) = begun else { return None };
        let retry = shared.options.transaction_retry;
        tracing::warn!(%error, attempt, ?retry, entity_type = %shared.entity_type, "could not begin a transaction; retrying");
        tokio::select! {
            biased;
            outcome = interruption.as_mut() => return Some(outcome),
            () = tokio::time::sleep(retry) => {}
        }
    }
}

/// Runs a handler that did not finish on its first poll to its end, or until one of its
/// interrupt sources fires: the request's own, the instance's interruption, its restart, or
/// (for requests that do not wait for the graceful drain) the start of its stopping.
async fn until_interrupted<F>(
    handled: std::pin::Pin<&mut F>,
    interrupted: &InterruptSignal,
    signals: &Signals,
    generation: &InterruptSignal,
    interrupt_on_termination: bool,
) -> Outcome
where
    F: std::future::Future<Output = std::thread::Result<Exit>>,
{
    let stopping = async {
        if interrupt_on_termination {
            signals.stopping.cancelled().await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        biased;
        handled = handled => match handled {
            Ok(exit) => Outcome::Exited(exit),
            Err(_) => Outcome::Panicked,
        },
        () = interrupted.cancelled() => Outcome::Exited(Exit::interrupt()),
        () = signals.interrupt.cancelled() => Outcome::Exited(Exit::interrupt()),
        () = generation.cancelled() => Outcome::Restarted,
        () = stopping => Outcome::Exited(Exit::interrupt()),
    }
}

mod instances;

#[cfg(test)]
mod tests;
