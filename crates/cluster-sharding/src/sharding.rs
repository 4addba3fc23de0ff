//! [`Sharding`]: the runtime of one process, a thin handle on its components.
//!
//! The handle registers entity types and singletons, hands out typed clients, reports
//! registrations and runs the shutdown sequence. Everything else is a component with narrow
//! inputs, which the handle builds and calls:
//!
//! - `Managers` (`registry`): the entity managers by type;
//! - `Shards` (`shards`): the shards served now, and the shutdown flag;
//! - `LocalDelivery` (`local`): requests to this runner's entities;
//! - `Remote` (`remote`): volatile requests routed to their owner;
//! - `PersistedDelivery` (`persisted`): saved requests, the read loop, stored replies;
//! - `Member` (`member`): membership, shard locks and the handoff;
//! - `Singletons` (`singleton`): tasks on the runner that holds their shard.
//!
//! Components that call back into the runtime do so through a trait they define
//! (`MemberHost`, `SingletonHost`), which the handle implements. See `ARCHITECTURE.md`.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::config::{Capacity, ShardingConfig};
use cluster_core::envelope::{Exit, RawJson, Request};
use cluster_core::error::ConfigError;
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::reply_handlers::UnregisterMode;
use cluster_core::snowflake::SharedSnowflakeGenerator;
use cluster_core::storage::{MessageStorage, SaveRequestOptions};
use cluster_core::sync::lock;
use cluster_core::transport::{RunnerHandler, Transport};
use cluster_core::{
    Clock, ClusterError, EntityAddress, EntityId, EntityType, MachineId, ShardGroup, ShardId,
    Snowflake, Tag, Timestamp,
};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::api::client::EntityClient;
use crate::api::entity::Ids;
use crate::api::entity::{
    DEFAULT_ON_STOP_TIMEOUT, Entity, EntityContext, EntityOptions, Handler, Protocol, RuntimeHandle,
};
use crate::api::rpc::{CallError, Rpc};
use crate::error::RegisterError;
use crate::metrics;
use crate::placement::member::{Member, MemberHost, Readiness};
use crate::placement::remote::{Remote, RemoteParts};
use crate::placement::shards::Shards;
use crate::placement::single_runner::{HeldLocks, all_shards};
use crate::runtime::delivery::{ReadLatch, Serving};
use crate::runtime::keep_alive::{KEEP_ALIVE_TAG, KeepAliveSender};
use crate::runtime::local::{LocalDelivery, StreamCall};
use crate::runtime::manager::{Contexts, EntityManager, Factory, Lent, ManagerOptions, Residency};
use crate::runtime::persisted::{PersistedDelivery, PersistedParts, PersistedStream, not_stored};
use crate::runtime::registry::Managers;
use crate::services::cron::{self, CronContext, CronEntity, CronError, CronHost, CronOptions};
use crate::services::singleton::{
    self, SingletonContext, SingletonHost, SingletonOptions, Singletons,
};

/// What [`Sharding::registration_events`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegistrationEvent {
    /// An entity type was registered on this runner.
    EntityRegistered(EntityType),
    /// A singleton was registered on this runner.
    SingletonRegistered(String),
}

/// How many registration events a slow subscriber may lag behind before it misses some.
const REGISTRATION_EVENTS_MAX: usize = 64;

/// The runtime of one process; cheap to clone (a handle).
#[derive(Clone)]
pub struct Sharding {
    inner: Arc<Inner>,
}

struct Inner {
    config: ShardingConfig,
    clock: Arc<dyn Clock>,
    ids: Arc<Ids>,
    managers: Arc<Managers>,
    events: broadcast::Sender<RegistrationEvent>,
    residency: Arc<Residency>,
    /// Persisted delivery, when the runtime has a message storage.
    persisted: Option<Arc<PersistedDelivery>>,
    /// Every background task of the runtime; awaited at shutdown.
    tasks: TaskTracker,
    /// The shards served here: by a cluster member, a single runner's locks, or all of them.
    shards: Arc<Shards>,
    /// Requests to the entities of this runner.
    local: Arc<LocalDelivery>,
    singletons: Arc<Singletons>,
    /// Routing of volatile requests, and the server side of the transport.
    remote: Arc<Remote>,
    /// Services attached to the runtime by the layers built on it (see
    /// [`Sharding::insert_extension`]).
    extensions: Mutex<BTreeMap<std::any::TypeId, Arc<dyn std::any::Any + Send + Sync>>>,
}

/// The last handle is gone without [`Sharding::shutdown`]: the runtime's loops stop, as its
/// tasks would in a process that exits.
/// Its entities are not drained and its locks are not released (they expire).
impl Drop for Inner {
    fn drop(&mut self) {
        if !self.shards.shutdown().is_cancelled() {
            tracing::debug!(
                "the last handle on the runtime was dropped without a shutdown: stopping its loops"
            );
            self.shards.shutdown().cancel();
        }
    }
}

/// A handle on the runtime that does not keep it alive: what its managers hold, and what a
/// layer above holds in the state that the runtime's own registrations keep (see
/// [`Plumbing::downgrade`](crate::Plumbing::downgrade)).
#[derive(Clone)]
pub struct WeakSharding(std::sync::Weak<Inner>);

impl std::fmt::Debug for WeakSharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeakSharding").field("alive", &(self.0.strong_count() > 0)).finish()
    }
}

impl WeakSharding {
    /// The runtime, unless every [`Sharding`] handle is gone.
    pub fn upgrade(&self) -> Option<Sharding> {
        self.0.upgrade().map(|inner| Sharding { inner })
    }
}

/// The base of provisional machine ids: unset (`u64::MAX`) until drawn.
static PROVISIONAL_BASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);
/// How many provisional machine ids were handed out since the base was drawn.
static PROVISIONAL_NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The machine id of a runtime until the registry gives it one, unless its builder set one
/// ([`ShardingBuilder::provisional_machine_id`](crate::ShardingBuilder::provisional_machine_id)): a random base drawn once per process, plus a
/// counter, so that runtimes of one process never share one and processes (including
/// containers whose processes all have the same pid) rarely do. Ids of two runtimes with one
/// machine id collide within a millisecond.
fn provisional_machine_id() -> MachineId {
    use std::sync::atomic::Ordering;
    let mut base = PROVISIONAL_BASE.load(Ordering::Acquire);
    if base == u64::MAX {
        let mut bytes = [0u8; 4];
        let drawn = match getrandom::fill(&mut bytes) {
            Ok(()) => u32::from_le_bytes(bytes),
            // No OS randomness: the process id still spreads processes on one host.
            Err(_) => std::process::id(),
        };
        base = match PROVISIONAL_BASE.compare_exchange(
            u64::MAX,
            u64::from(drawn),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => u64::from(drawn),
            Err(current) => current,
        };
    }
    let n = u64::from(PROVISIONAL_NEXT.fetch_add(1, Ordering::AcqRel));
    MachineId::new(i32::try_from(base.wrapping_add(n) % 1024).unwrap_or(0))
}

/// What every runtime starts from, whatever its role: its configuration, its clock and its
/// provisional machine id, if its builder set one.
pub(crate) struct Basics {
    pub(crate) config: ShardingConfig,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) machine_id: Option<MachineId>,
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharding")
            .field("runner", &self.inner.config.runner_address)
            .finish_non_exhaustive()
    }
}

impl Sharding {
    /// A runtime with no storage (see [`Sharding::volatile`]): only volatile requests can be
    /// sent.
    pub(crate) fn start_volatile(basics: Basics) -> Result<Sharding, ConfigError> {
        Sharding::build(basics, None, None, None)
    }

    /// A single runner that owns every shard of its groups, with persisted delivery through
    /// `storage`, and starts its storage read loop.
    ///
    /// Use it for one process on its own storage: shard locks and the runner registry, which
    /// let several runners share a database, are not taken here.
    pub(crate) async fn start_own_storage(
        basics: Basics,
        storage: Arc<dyn MessageStorage>,
    ) -> Result<Sharding, ConfigError> {
        let config = &basics.config;
        let groups = config.shard_groups().assigned;
        let shards = all_shards(&groups, config.shards_per_group);
        // Taking the shards releases the claims a previous run left behind (it may have been
        // killed while holding them), as the reference does when it acquires shards.
        if let Err(error) = storage.reset_shards(&shards).await {
            tracing::warn!(%error, "could not release the claims of a previous run");
        }
        metrics::set(metrics::SHARDS, shards.len());
        Sharding::build(basics, Some((storage, shards)), None, None)
    }

    /// The runtime of a cluster member (see [`Sharding::cluster`]): persisted delivery through
    /// `storage` on the shards `cluster` holds; the member's loops are started by the caller.
    pub(crate) fn with_cluster(
        basics: Basics,
        storage: Arc<dyn MessageStorage>,
        cluster: Arc<Member>,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<Sharding, ConfigError> {
        Sharding::build(basics, Some((storage, Vec::new())), Some(cluster), transport)
    }

    /// A client-only process on `storage` (the reference's client-only mode; `runner_address`
    /// must be `None`): it hosts no entity (registering is a no-op) and reads no mailbox. Its
    /// persisted requests are saved for the runners that own their shards, and their replies
    /// are read back from storage every `entity_reply_poll_interval`. Volatile requests need a
    /// transport to reach their runner, which this process does not have: they fail with
    /// `EntityNotAssignedToRunner`.
    pub(crate) fn start_client_only(
        basics: Basics,
        storage: Arc<dyn MessageStorage>,
    ) -> Result<Sharding, ConfigError> {
        let config = &basics.config;
        if config.runner_address.is_some() {
            return Err(ConfigError::new(
                "runner_address",
                config.runner_address.as_ref().map(ToString::to_string).unwrap_or_default(),
                "a client-only process has no runner address",
            ));
        }
        Sharding::build(basics, Some((storage, Vec::new())), None, None)
    }

    /// Whether this process hosts entities (it has a runner address).
    pub fn is_runner(&self) -> bool {
        self.inner.config.runner_address.is_some()
    }

    /// Puts the components together on `storage` (with the shards its read loop reads when
    /// no lock says otherwise), `cluster` and `transport`, and starts persisted delivery's
    /// loops.
    fn build(
        basics: Basics,
        storage: Option<(Arc<dyn MessageStorage>, Vec<ShardId>)>,
        cluster: Option<Arc<Member>>,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<Sharding, ConfigError> {
        let Basics { config, clock, machine_id } = basics;
        config.validate()?;
        if !config.simulate_remote_serialization {
            tracing::info!(
                "simulate_remote_serialization is off, which has no effect here: local requests are always encoded and decoded"
            );
        }
        // The reference starts with a random machine id until the runner registers (a
        // client-only process keeps it).
        let machine_id = machine_id.unwrap_or_else(provisional_machine_id);
        let ids = Arc::new(Ids::new(
            Arc::clone(&clock),
            SharedSnowflakeGenerator::new(machine_id, clock.now()),
        ));
        let residency = Arc::new(Residency::new(config.max_resident_entities));
        let runners = usize::from(config.runner_address.is_some());
        metrics::set(metrics::RUNNERS, runners);
        metrics::set(metrics::RUNNERS_HEALTHY, runners);
        let tasks = TaskTracker::new();
        let all = all_shards(&config.shard_groups().assigned, config.shards_per_group);
        let shards_served = Arc::new(Shards::new(config.runner_address.is_some(), cluster, all));
        let shutdown = shards_served.shutdown().token();
        let read_latch = Arc::new(ReadLatch::default());
        let managers = Arc::new(Managers::default());
        let local = Arc::new(LocalDelivery::new(
            Arc::clone(&managers),
            Arc::clone(&shards_served),
            Arc::clone(&ids),
            config.entity_registration_timeout,
            shutdown.clone(),
        ));
        let remote = Arc::new(Remote::new(
            &config,
            RemoteParts {
                transport,
                shards: Arc::clone(&shards_served),
                local: Arc::clone(&local),
                managers: Arc::clone(&managers),
                ids: Arc::clone(&ids),
                read_latch: Arc::clone(&read_latch),
                tasks: tasks.clone(),
            },
        ));
        let persisted = storage.map(|(storage, shards)| {
            Arc::new(PersistedDelivery::new(PersistedParts {
                storage,
                shards,
                config: config.clone(),
                clock: Arc::clone(&clock),
                ids: Arc::clone(&ids),
                serving: Arc::clone(&shards_served),
                remote: Arc::clone(&remote),
                managers: Arc::clone(&managers),
                residency: Arc::clone(&residency),
                read_latch,
                tasks: tasks.clone(),
            }))
        });
        // The reply poller, and for a runner the storage read loop.
        if let Some(persisted) = &persisted {
            persisted.start(config.runner_address.is_some());
        }
        let singletons = Arc::new(Singletons::new(
            config.entity_termination_timeout,
            tasks.clone(),
            shutdown.clone(),
        ));
        Ok(Sharding {
            inner: Arc::new(Inner {
                config,
                clock,
                ids,
                managers,
                events: broadcast::channel(REGISTRATION_EVENTS_MAX).0,
                residency,
                persisted,
                tasks,
                shards: shards_served,
                local,
                singletons,
                remote,
                extensions: Mutex::new(BTreeMap::new()),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ShardingConfig {
        &self.inner.config
    }

    /// Registers the singleton `name`: `run` is called on the one runner that holds the lock
    /// of the name's shard, again whenever the shard comes back to this runner, and (after a
    /// backoff) when it panics. It stops (its [`SingletonContext::cancellation`] fires, then
    /// it gets `entity_termination_timeout` before it is dropped) before the shard's lock is
    /// released. In a client-only process this is a no-op, as in the reference.
    ///
    /// ```
    /// use cluster_core::ShardingConfig;
    /// use cluster_sharding::{Sharding, SingletonOptions};
    /// use tokio::sync::mpsc;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let sharding = Sharding::volatile(ShardingConfig::default()).start().await?;
    /// let (events, mut received) = mpsc::channel(4);
    /// sharding.register_singleton("reaper", SingletonOptions::default(), move |context| {
    ///     let events = events.clone();
    ///     async move {
    ///         let _ = events.send("started").await;
    ///         // Work until the runner stops or hands the singleton's shard over.
    ///         context.cancellation().cancelled().await;
    ///         let _ = events.send("stopped").await;
    ///     }
    /// })?;
    /// assert_eq!(received.recv().await, Some("started"));
    /// sharding.shutdown().await;
    /// assert_eq!(received.recv().await, Some("stopped"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_singleton<F, Fut>(
        &self,
        name: impl Into<String>,
        options: SingletonOptions,
        run: F,
    ) -> Result<(), RegisterError>
    where
        F: Fn(SingletonContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if self.is_shutdown() {
            return Err(RegisterError::ShuttingDown);
        }
        if !self.is_runner() {
            return Ok(());
        }
        let name: Arc<str> = Arc::from(name.into());
        let group = options.shard_group.unwrap_or_else(ShardGroup::default_group);
        let shard = self.shard_id(&name, &group);
        let run: singleton::Run = Arc::new(move |context| Box::pin(run(context)));
        self.inner.singletons.insert(&name, shard, run)?;
        tracing::debug!(singleton = %name, "singleton registered");
        self.publish(RegistrationEvent::SingletonRegistered(name.to_string()));
        self.sync_singletons();
        Ok(())
    }

    /// Starts the singletons whose shard this runner serves and stops the others (without
    /// waiting for them; see [`stop_singletons_in`](Sharding::stop_singletons_in)).
    pub(crate) fn sync_singletons(&self) {
        self.inner.singletons.sync(self);
    }

    /// Stops the singletons of `shard` (all of them with `None`) and waits until they ended.
    pub(crate) async fn stop_singletons_in(&self, shard: Option<&ShardId>) {
        self.inner.singletons.stop_in(shard).await;
    }

    /// Registers the cron job `name`: `execute` runs once per instant of `expression` (five
    /// fields, or six with seconds first; UTC) across the cluster, on whichever runner stores
    /// and reads its runs (docs/sharding.md, "Cron jobs"). Register it on every runner. On a
    /// client-only process nothing runs.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    ///
    /// use cluster_core::ShardingConfig;
    /// use cluster_sharding::{CronOptions, Sharding};
    /// use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions};
    /// use tokio::sync::mpsc;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let path = std::env::temp_dir().join(format!("doc-cron-{}.db", std::process::id()));
    /// // Runs are stored messages: a short poll interval finds the first one sooner.
    /// let config = ShardingConfig {
    ///     entity_message_poll_interval: Duration::from_millis(100),
    ///     ..ShardingConfig::default()
    /// };
    /// let messages = SqliteMessageStorage::open(&path, SqliteOptions::default()).await?;
    /// let sharding = Sharding::standalone(config, Arc::new(messages)).start().await?;
    /// let (runs, mut ran) = mpsc::channel(16);
    /// // Every second (six fields: seconds first).
    /// sharding.register_cron("heartbeat", "* * * * * *", CronOptions::default(), move |context| {
    ///     let runs = runs.clone();
    ///     async move {
    ///         let _ = runs.send(context.scheduled()).await;
    ///         Ok::<(), String>(())
    ///     }
    /// })?;
    /// let first = tokio::time::timeout(Duration::from_secs(30), ran.recv()).await?;
    /// assert!(first.is_some());
    /// sharding.shutdown().await;
    /// # for suffix in ["", "-wal", "-shm"] {
    /// #     let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    /// # }
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_cron<F, Fut, E>(
        &self,
        name: impl Into<String>,
        expression: &str,
        options: CronOptions,
        execute: F,
    ) -> Result<(), CronError>
    where
        F: Fn(CronContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: std::fmt::Display + 'static,
    {
        if self.persisted().is_none() {
            return Err(CronError::NoMessageStorage);
        }
        let execute: cron::Execute = Arc::new(move |context| {
            let run = execute(context);
            Box::pin(async move { run.await.map_err(|error| error.to_string()) })
        });
        let job = Arc::new(cron::Job::new(name.into(), expression, options, execute)?);
        let entity_type = job.entity_type().clone();
        // The instances get the runtime from their context: a factory that kept it would keep
        // the runtime alive through its own managers.
        let entity_job = Arc::clone(&job);
        self.entity()
            .named(entity_type.clone())
            .factory(move |context| {
                CronEntity::<Sharding>::new(Arc::clone(&entity_job), context.sharding().clone())
            })
            .register()?;
        let singleton = SingletonOptions { shard_group: Some(job.shard_group()) };
        self.register_singleton(entity_type.to_string(), singleton, move |context| {
            let host = context.sharding().clone();
            cron::start_schedule(host, Arc::clone(&job), context.cancellation().clone())
        })?;
        Ok(())
    }

    /// Registers entity type `E` as `entity_type`, its instances made by `factory`
    /// (`EntityRegistration::register`).
    pub(crate) fn register_factory<E: Entity>(
        &self,
        entity_type: EntityType,
        options: EntityOptions,
        factory: Factory<E>,
    ) -> Result<(), RegisterError> {
        if self.is_shutdown() {
            return Err(RegisterError::ShuttingDown);
        }
        if let Err(error) = options.validate() {
            return Err(RegisterError::InvalidOptions { entity_type, error });
        }
        if !self.is_runner() {
            return Ok(());
        }
        let config = &self.inner.config;
        let manager_options = ManagerOptions {
            max_idle_time: options.max_idle_time.unwrap_or(config.entity_max_idle_time),
            mailbox_capacity: options.mailbox_capacity.unwrap_or(config.entity_mailbox_capacity),
            concurrency: options.concurrency.unwrap_or(Capacity::Bounded(NonZeroU32::MIN)),
            on_stop_timeout: options.on_stop_timeout.unwrap_or(DEFAULT_ON_STOP_TIMEOUT),
            transaction_retry: config.send_retry_interval,
            mailbox_metrics: config.entity_mailbox_metrics,
            defects: options.defects.unwrap_or_default(),
            max_resident: options.max_resident.unwrap_or(Capacity::Unbounded),
        };
        let storage = self.message_storage().cloned();
        if storage.is_none() && Protocol::<E>::of().durability().is_some() {
            return Err(RegisterError::NoStateStorage(entity_type));
        }
        let inserted = self.inner.managers.insert(&entity_type, || {
            Arc::new(EntityManager::<E>::new(
                self.contexts(),
                entity_type.clone(),
                factory,
                manager_options,
                Lent {
                    residency: Arc::clone(&self.inner.residency),
                    ids: Arc::clone(&self.inner.ids),
                    keep_alive_sender: self.keep_alive_sender(),
                    storage,
                },
            ))
        });
        if !inserted {
            return Err(RegisterError::AlreadyRegistered(entity_type));
        }
        tracing::debug!(%entity_type, "entity registered");
        // Nobody may be subscribed: that is not an error.
        let _ = self.inner.events.send(RegistrationEvent::EntityRegistered(entity_type));
        // Messages held while the type was unknown are read again.
        self.poll_storage();
        Ok(())
    }

    /// A typed client for the entity `entity_id` of type `E`, under its own name
    /// ([`Entity::TYPE`]); one registered under another name is reached with
    /// `EntityRegistration::client`.
    pub fn client<E: Entity>(&self, entity_id: impl Into<EntityId>) -> EntityClient<E> {
        let entity_id = entity_id.into();
        let shard_id = self.shard_id(entity_id.as_str(), &E::shard_group(entity_id.as_str()));
        let address =
            EntityAddress { shard_id, entity_type: EntityType::from_static(E::TYPE), entity_id };
        EntityClient::new(self.clone(), address)
    }

    /// The shard of `entity_id` in `group`.
    pub fn shard_id(&self, entity_id: &str, group: &ShardGroup) -> ShardId {
        self.inner.config.shard_id(entity_id, group)
    }

    /// The number of resident entity instances on this runner.
    pub fn active_entity_count(&self) -> usize {
        self.inner.managers.active_entities()
    }

    /// Whether [`shutdown`](Sharding::shutdown) was called.
    pub fn is_shutdown(&self) -> bool {
        self.inner.shards.shutdown().is_cancelled()
    }

    /// Stops the runner: new requests fail with `EntityNotAssignedToRunner`, the ones already
    /// delivered get `entity_termination_timeout` to finish, then they are interrupted; every
    /// entity instance has ended (and run its `on_stop`) when this returns. Interrupted
    /// persisted requests stay stored for the next run, and no interrupt is stored for them;
    /// local callers still waiting for a persisted reply fail with
    /// [`ClusterError::Abandoned`]. Idempotent.
    pub async fn shutdown(&self) {
        self.inner.shards.shutdown().cancel();
        if let Some(cluster) = self.cluster() {
            // Requests waiting for a shard's lock stop waiting.
            cluster.shutting_down();
        }
        let termination_timeout = self.inner.config.entity_termination_timeout;
        let managers = self.inner.managers.all();
        // Local callers of persisted requests that no handler started will not get their
        // reply here: they hear at once that it is left for the next owner, so that a handler
        // the drain waits for is not stuck on one of them (reference `abandonUndelivered`).
        if let Some(persisted) = &self.inner.persisted {
            persisted.abandon_undelivered();
        }
        // The types and the singletons drain side by side: the whole shutdown takes one
        // termination timeout.
        let entities = futures_util::future::join_all(
            managers.iter().map(|manager| manager.shutdown(termination_timeout)),
        );
        futures_util::future::join(entities, self.stop_singletons_in(None)).await;
        // The entities have stopped: the shards go to other runners at once.
        if let Some(cluster) = self.cluster() {
            cluster.hand_off(self).await;
        }
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
        // No reply will be read from here on: local callers stop waiting.
        if let Some(persisted) = &self.inner.persisted {
            persisted.abandon_waiters();
        }
        // The entities have stopped: the shards can go to the next runner.
        if let Some(locks) = self.held_locks() {
            locks.release().await;
        }
    }

    /// Whether this process serves what the cluster assigns it, for a readiness probe.
    ///
    /// - A cluster member reports its registration, its lock storage and its assigned shards.
    /// - A single runner is registered and assigned every shard of its groups; its lock storage
    ///   counts as healthy while it holds every lock.
    /// - A client is assigned nothing and holds no lock.
    pub fn readiness(&self) -> Readiness {
        if let Some(member) = self.cluster() {
            return member.readiness();
        }
        if !self.is_runner() {
            return Readiness {
                runner: false,
                registered: false,
                lock_storage_healthy: true,
                assigned: 0,
                not_acquired: 0,
                unserved: 0,
            };
        }
        let assigned = self.inner.shards.all().len();
        let not_acquired = assigned.saturating_sub(self.acquired_shards().len());
        Readiness {
            runner: true,
            registered: true,
            lock_storage_healthy: not_acquired == 0,
            assigned,
            not_acquired,
            unserved: not_acquired,
        }
    }

    /// The shards this runner holds the lock of and runs (every shard of its groups for a
    /// single runner; none for a client).
    pub fn acquired_shards(&self) -> Vec<ShardId> {
        self.inner.shards.acquired()
    }

    /// Whether this runner serves requests of `shard` now (see [`Shards::serves`]).
    pub(crate) fn serves(&self, shard: &ShardId) -> bool {
        self.inner.shards.serves(shard)
    }

    /// Stamps new ids with the machine id the runner registry gave this runner.
    pub(crate) fn set_machine_id(&self, machine_id: MachineId) {
        self.inner.ids.set_machine_id(machine_id);
    }

    /// Keeps a single runner's `locks` (see [`Shards::hold_locks`]).
    pub(crate) fn hold_locks(&self, locks: Arc<HeldLocks>) {
        self.inner.shards.hold_locks(locks);
    }

    /// The shard locks of a single runner, if it holds them in a runner storage.
    pub(crate) fn held_locks(&self) -> Option<&Arc<HeldLocks>> {
        self.inner.shards.held_locks()
    }

    /// The registrations made on this runner from now on. A subscriber that falls more than 64
    /// events behind misses the oldest ones (`RecvError::Lagged`).
    pub fn registration_events(&self) -> broadcast::Receiver<RegistrationEvent> {
        self.inner.events.subscribe()
    }

    /// Resets a persisted request so that it runs again (the reference's `reset`): its final
    /// reply is deleted and it is delivered anew.
    ///
    /// With `expected_reply_id`, only if that is still the request's latest reply.
    ///
    /// # Errors
    ///
    /// [`ClusterError::Persistence`]: the storage failed, or this runtime has no message
    /// storage (an `InvalidInput` error that says so).
    pub async fn reset(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> Result<(), ClusterError> {
        let Some(persisted) = self.persisted() else {
            let message = "this runtime has no message storage, so no persisted request to \
                           reset: start it with a message storage (`Sharding::standalone`, `single_runner` \
                           or `member`)";
            return Err(StorageError::new(StorageErrorKind::InvalidInput, message).into());
        };
        persisted.storage.clear_replies(request_id, expected_reply_id).await.inspect_err(
            |error| tracing::warn!(%error, %request_id, "could not reset a request"),
        )?;
        persisted.poll_storage();
        Ok(())
    }

    /// What wakes the storage read loop; without a message storage there is no read loop, and
    /// the latch wakes nothing.
    pub(crate) fn read_latch(&self) -> Arc<ReadLatch> {
        self.persisted().map(|persisted| Arc::clone(persisted.read_latch())).unwrap_or_default()
    }

    /// Saves a persisted request and waits for its final reply's exit (see
    /// [`PersistedDelivery::send_persisted`]).
    pub(crate) async fn send_persisted(
        &self,
        request: Request,
        options: SaveRequestOptions,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        let Some(persisted) = self.persisted() else {
            return Err(not_stored(&request.address));
        };
        let (address, request_id) = (request.address.clone(), request.request_id);
        let call = persisted.send_persisted(request, options, uninterruptible);
        crate::placement::unserved::watched(
            self.cluster(),
            self.config(),
            &address,
            request_id,
            call,
        )
        .await
    }

    /// Saves a persisted streaming request; its chunks and final reply arrive on the returned
    /// stream.
    pub(crate) async fn stream_persisted(
        &self,
        request: Request,
        options: SaveRequestOptions,
    ) -> Result<PersistedStream, ClusterError> {
        match self.persisted() {
            Some(persisted) => persisted.stream_persisted(request, options).await,
            None => Err(not_stored(&request.address)),
        }
    }

    /// Saves a persisted request without waiting for its reply (a discarded call).
    pub(crate) async fn notify_persisted(
        &self,
        request: Request,
        options: SaveRequestOptions,
    ) -> Result<(), ClusterError> {
        match self.persisted() {
            Some(persisted) => persisted.notify_persisted(request, options).await,
            None => Err(not_stored(&request.address)),
        }
    }

    /// Interrupts the persisted request `request_id` of the entity at `address`, wherever it
    /// runs.
    ///
    /// The interrupt is stored, and the owner's storage reader is woken (the reference's
    /// `Envelope.Interrupt`).
    /// A request that is not running is not affected.
    ///
    /// # Errors
    ///
    /// The interrupt could not be stored, or the runtime has no storage.
    pub async fn interrupt_request(
        &self,
        address: &EntityAddress,
        request_id: Snowflake,
    ) -> Result<(), ClusterError> {
        match self.persisted() {
            Some(persisted) => persisted.interrupt_request(address, request_id).await,
            None => Err(not_stored(address)),
        }
    }

    /// Wakes the storage read loop now, instead of at its next poll.
    pub(crate) fn poll_storage(&self) {
        if let Some(persisted) = &self.inner.persisted {
            persisted.poll_storage();
        }
    }

    /// Sends a volatile request to its entity, wherever it lives, and waits for its exit
    /// (see [`Remote::send`]).
    pub(crate) async fn send_volatile(
        &self,
        request: Request,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        self.inner.remote.send(request, uninterruptible).await
    }

    /// Delivers a volatile request without waiting for its exit (a discarded call).
    pub(crate) async fn notify_volatile(&self, request: Request) -> Result<(), ClusterError> {
        self.inner.remote.notify(request).await
    }

    /// Sends a volatile streaming request to its entity, wherever it lives.
    pub(crate) async fn stream_volatile(
        &self,
        request: Request,
    ) -> Result<StreamCall, ClusterError> {
        self.inner.remote.stream(request).await
    }

    /// What a transport calls when a peer's request arrives (the reference's `RunnerServer`).
    /// It does not keep the runtime alive.
    pub(crate) fn runner_handler(&self) -> Arc<dyn RunnerHandler> {
        self.inner.remote.handler()
    }

    /// A handle that does not keep the runtime alive.
    pub(crate) fn downgrade(&self) -> WeakSharding {
        WeakSharding(Arc::downgrade(&self.inner))
    }

    /// Publishes a registration event (nobody may be subscribed: that is not an error).
    pub(crate) fn publish(&self, event: RegistrationEvent) {
        let _ = self.inner.events.send(event);
    }

    /// The cluster side, when several runners share the storage.
    pub(crate) fn cluster(&self) -> Option<&Arc<Member>> {
        self.inner.shards.member()
    }

    pub(crate) fn persisted(&self) -> Option<&Arc<PersistedDelivery>> {
        self.inner.persisted.as_ref()
    }

    /// The clock the runtime reads (the wall clock, or a simulation's).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// The message storage of persisted requests, if the runtime has one: for layers built on
    /// the runtime (the workflow engine reads stored replies and deferred completions).
    pub(crate) fn message_storage(&self) -> Option<&Arc<dyn MessageStorage>> {
        self.persisted().map(|persisted| &persisted.storage)
    }

    /// Attaches a service to the runtime, one per type (replacing and returning an earlier
    /// one): how a layer built on the runtime, such as the workflow engine, reaches its state
    /// from the entities it registers.
    pub(crate) fn insert_extension<T: Send + Sync + 'static>(
        &self,
        value: Arc<T>,
    ) -> Option<Arc<T>> {
        let mut extensions = lock(&self.inner.extensions);
        extensions
            .insert(std::any::TypeId::of::<T>(), value)
            .and_then(|previous| previous.downcast::<T>().ok())
    }

    /// The service of type `T` attached with [`insert_extension`](Sharding::insert_extension).
    pub(crate) fn extension<T: Send + Sync + 'static>(&self) -> Option<Arc<T>> {
        let extensions = lock(&self.inner.extensions);
        extensions
            .get(&std::any::TypeId::of::<T>())
            .cloned()
            .and_then(|value| value.downcast::<T>().ok())
    }

    pub(crate) fn shutdown_token(&self) -> &CancellationToken {
        self.inner.shards.shutdown().token()
    }

    /// Runs `task` as a background task of the runtime, awaited at shutdown.
    pub(crate) fn spawn_owned(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.inner.tasks.spawn(task);
    }

    /// A fresh id.
    pub(crate) fn next_id(&self) -> Snowflake {
        self.inner.ids.next()
    }

    /// What entity managers call to make the context of a new instance: a weak handle, so
    /// that the managers do not keep the runtime alive.
    fn contexts(&self) -> Contexts {
        let runtime = self.downgrade();
        Arc::new(move |address: &EntityAddress| {
            let sharding = runtime.upgrade()?;
            Some(EntityContext::new(address.clone(), sharding.handle()))
        })
    }

    /// This runtime, for a context handed to user code (see [`Sharding::of`]).
    pub(crate) fn handle(&self) -> RuntimeHandle {
        RuntimeHandle(Arc::new(self.clone()))
    }

    /// The runtime in `handle`, which only [`Sharding::handle`] makes.
    fn of(handle: &RuntimeHandle) -> &Sharding {
        match handle.0.downcast_ref::<Sharding>() {
            Some(sharding) => sharding,
            // `RuntimeHandle` is crate-private, and `handle` is its only constructor.
            None => unreachable!("a runtime handle holds a Sharding"),
        }
    }

    /// What entity managers call to send the keep-alive request: a weak handle, so that the
    /// managers do not keep the runtime alive.
    fn keep_alive_sender(&self) -> KeepAliveSender {
        let inner = Arc::downgrade(&self.inner);
        Arc::new(move |address: EntityAddress| {
            let inner = inner.clone();
            Box::pin(async move {
                let Some(inner) = inner.upgrade() else {
                    return Err(ClusterError::EntityNotAssignedToRunner { address });
                };
                Sharding { inner }.send_keep_alive(address).await
            })
        })
    }

    /// A new request envelope: a fresh id, no headers, and the current span's trace context
    /// (see [`crate::trace`]). The tag is an RPC's `TAG`, which the envelope borrows.
    pub(crate) fn new_request(
        &self,
        address: EntityAddress,
        tag: &'static str,
        payload: RawJson,
    ) -> Request {
        Request {
            request_id: self.next_id(),
            address,
            tag: Tag::from_static(tag),
            payload,
            headers: RawJson::empty_object(),
            trace: crate::trace::current(),
        }
    }

    /// Sends the keep-alive request to `address`: stored when there is a message storage (it
    /// then survives a restart), delivered in memory otherwise.
    async fn send_keep_alive(&self, address: EntityAddress) -> Result<(), ClusterError> {
        let request = self.new_request(address, KEEP_ALIVE_TAG, RawJson::null());
        if self.persisted().is_some() {
            self.notify_persisted(request, SaveRequestOptions::default()).await
        } else {
            self.notify_local(request).await
        }
    }

    /// Delivers a volatile request without waiting for its exit (a discarded call).
    pub(crate) async fn notify_local(&self, request: Request) -> Result<(), ClusterError> {
        self.inner.local.notify(request).await
    }

    /// The entity managers of this runner.
    pub(crate) fn managers(&self) -> &Arc<Managers> {
        &self.inner.managers
    }
}

impl EntityContext {
    /// The runtime the instance runs in: `context.sharding().client::<Other>(id)` calls
    /// another entity. An instance that keeps it keeps the runtime alive until it stops.
    pub fn sharding(&self) -> &Sharding {
        Sharding::of(&self.runtime)
    }
}

impl CronContext {
    /// The runtime, to call entities.
    pub fn sharding(&self) -> &Sharding {
        Sharding::of(&self.runtime)
    }
}

/// Cron jobs read the runtime's clock and send their runs through it.
impl CronHost for Sharding {
    fn now(&self) -> Timestamp {
        self.clock().now()
    }

    fn is_shutdown(&self) -> bool {
        Sharding::is_shutdown(self)
    }

    fn handle(&self) -> RuntimeHandle {
        Sharding::handle(self)
    }

    async fn discard<R: Rpc>(
        &self,
        job: &cron::Job,
        entity_id: String,
        request: R,
    ) -> Result<(), CallError<R::Error>>
    where
        CronEntity<Sharding>: Handler<R>,
    {
        let group = job.shard_group();
        let client = self
            .entity::<CronEntity<Sharding>>()
            .named(job.entity_type().clone())
            .client_in(&group, entity_id);
        client.discard(request).await
    }
}

impl SingletonContext {
    /// The runtime, to call entities.
    pub fn sharding(&self) -> &Sharding {
        Sharding::of(&self.runtime)
    }
}

/// Singletons run where the runtime serves their shard, and get the runtime in their context.
impl SingletonHost for Sharding {
    fn handle(&self) -> RuntimeHandle {
        Sharding::handle(self)
    }
}

/// A cluster member takes and lets go of the runtime's shards.
impl MemberHost for Sharding {
    fn is_shutdown(&self) -> bool {
        Sharding::is_shutdown(self)
    }

    fn spawn_owned(&self, task: impl Future<Output = ()> + Send + 'static) {
        Sharding::spawn_owned(self, task);
    }

    fn managers(&self) -> &Arc<Managers> {
        Sharding::managers(self)
    }

    fn sync_singletons(&self) {
        Sharding::sync_singletons(self);
    }

    fn stop_singletons_in(&self, shard: Option<&ShardId>) -> impl Future<Output = ()> + Send {
        self.inner.singletons.stop_in(shard)
    }

    fn set_machine_id(&self, machine_id: MachineId) {
        Sharding::set_machine_id(self, machine_id);
    }

    fn poll_storage(&self) {
        Sharding::poll_storage(self);
    }

    async fn writes_finished(&self, shard: Option<&ShardId>, bound: Duration) {
        if let Some(persisted) = self.persisted() {
            persisted.writes_finished(shard, bound).await;
        }
    }

    fn abandon_waiters_of(&self, shard: &ShardId) {
        if let Some(persisted) = self.persisted() {
            persisted.unregister_shard(shard, UnregisterMode::Abandon);
        }
    }
}

/// The managers check the runtime's shards before they admit a request.
impl Serving for Sharding {
    fn serves(&self, shard: &ShardId) -> bool {
        Sharding::serves(self, shard)
    }
}
#[cfg(test)]
mod machine_id_tests {
    use super::*;

    #[test]
    fn runtimes_of_one_process_get_distinct_provisional_machine_ids() {
        let ids: std::collections::BTreeSet<i32> =
            (0..64).map(|_| provisional_machine_id().snowflake_bits().into()).collect();
        assert_eq!(ids.len(), 64);
        assert!(ids.iter().all(|id| (0..1024).contains(id)));
    }

    /// A builder's provisional machine id is its runtime's, with other runtimes built in
    /// between: a simulation sets one per runtime without a process-wide setting.
    #[tokio::test]
    async fn a_builder_sets_its_runtimes_provisional_machine_id() {
        let config = ShardingConfig::default();
        let seeded = Sharding::volatile(config.clone())
            .provisional_machine_id(MachineId::new(7))
            .start()
            .await
            .unwrap();
        let drawn = Sharding::volatile(config.clone()).start().await.unwrap();
        let again = Sharding::volatile(config)
            .provisional_machine_id(MachineId::new(7))
            .start()
            .await
            .unwrap();
        let machine = |sharding: &Sharding| sharding.inner.ids.next().machine_id();
        assert_eq!(machine(&seeded), MachineId::new(7));
        assert_eq!(machine(&again), MachineId::new(7));
        for sharding in [seeded, drawn, again] {
            sharding.shutdown().await;
        }
    }
}
