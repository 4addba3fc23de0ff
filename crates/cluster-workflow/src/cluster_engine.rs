//! The cluster engine (the reference's `ClusterWorkflowEngine`,
//! `effect/src/cluster/ClusterWorkflowEngine.ts`): every durable fact is a persisted request of the
//! execution's entity and its reply, so an execution survives restarts and moves with its shard.
//!
//! Entity `Workflow/<name>` (id: the execution id, shard group from the workflow's options)
//! with the requests `run` (primary key `""`: one per execution; its reply is the current
//! [`WorkflowResult`], and a replay is a conditional reset of it), `activity` (key
//! `<name>/<attempt>`), `deferred` (key: the deferred's name; the first completion wins) and
//! `resume` (key: the waking child's execution id, or `""`); entity `Workflow/-/DurableClock`
//! with `run` (key: the clock's name, delivered at its wake-up time). Names, keys and JSON
//! encodings are the reference's, so the two implementations read each other's executions.
//!
//! The parts:
//!
//! - this module: the engine's shared state, its construction on a runtime and its helpers;
//! - `requests`: the requests above in their JSON forms;
//! - `activation`: one lifetime of an execution's entity on this runner, and the entities;
//! - `contract`: the engine contract (`Backend`) as requests of the execution's entity.

use cluster_sharding::Plumbing;
use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cluster_core::backoff::Backoff;
use cluster_core::config::Capacity;
use cluster_core::envelope::{Envelope, Exit, RawJson, Reply, primary_key};
use cluster_core::queue_storage::QueueStorage;
use cluster_core::storage::MessageStorage;
use cluster_core::sync::lock;
use cluster_core::{EntityAddress, EntityType, ShardGroup, Snowflake};
use cluster_sharding::{
    CallError, EntityClient, EntityOptions, RegisterError, RequestContext, Rpc, Sharding,
    WeakSharding,
};

use crate::context::Never;
use crate::definition::WorkflowOptions;
use crate::engine::{Registration, ResumeMode, WorkflowEngine, WorkflowError};
use crate::id::ExecutionId;
use crate::queue::{QueueOptions, QueueWorkers};
use crate::result::WorkflowResult;

/// The deferred a durable interrupt is stored under.
pub const INTERRUPT_SIGNAL: &str = "Workflow/InterruptSignal";
/// The deferred that marks a stored interrupt as unsafe (`interrupt_unsafe`): the next run
/// applies it however it ends, not only at a suspension. New here: the reference keeps the
/// unsafe part in memory only (`ClusterWorkflowEngine.interruptUnsafe`), so a run that replays
/// after it and completes loses it. TypeScript runners read it as a completion nothing awaits.
pub const INTERRUPT_UNSAFE: &str = "Workflow/InterruptUnsafe";
/// The payload key of a child's parent in its `run` request.
pub const PARENT_KEY: &str = "~effect/cluster/ClusterWorkflowEngine/payloadParentKey";
/// The entity type of durable clocks.
pub const CLOCK_ENTITY: &str = "Workflow/-/DurableClock";
/// How long a workflow or clock entity stays resident without requests.
const MAX_IDLE: Duration = Duration::from_secs(10);
/// How many requests of one execution run at once: its run, its activities and the
/// deferred, resume and interrupt traffic that wakes it.
const CONCURRENCY: u32 = 256;

mod activation;
mod contract;
mod requests;
mod retention;

use activation::{Activation, ClockEntity, WorkflowEntity};
use requests::{DeferredRpc, ExitJson, ParentJson, ResultJson, ResumeRpc, RunRpc};

/// The cluster engine's shared state, attached to its runtime as an extension.
pub(crate) struct ClusterEngine {
    me: Weak<ClusterEngine>,
    /// The runtime, held weakly: it keeps this engine (in its entities' factories), so a
    /// strong handle here would keep both alive, with their connections, forever.
    /// [`WorkflowEngine`]'s handle keeps the runtime alive instead.
    sharding: WeakSharding,
    storage: Arc<dyn MessageStorage>,
    /// Bodies registered on this runner.
    registrations: Mutex<BTreeMap<&'static str, Registration>>,
    /// Definitions seen on this runner (for routing by shard group), registered or not.
    definitions: Mutex<BTreeMap<String, WorkflowOptions>>,
    /// The activations resident here, by execution.
    activations: Mutex<BTreeMap<ExecutionId, Weak<Activation>>>,
    /// The durable queues: their store and this engine's workers.
    queues: QueueWorkers,
}

/// What [`WorkflowEngine::cluster_with`] adds to the runtime's storages.
#[derive(Clone, Debug, Default)]
pub struct ClusterOptions {
    /// The persisted queue of durable queue items (the reference's `PersistedQueue` store), for
    /// example a SQL queue store on the cluster's database. Every process that offers items or
    /// runs a queue's worker needs one on the same table; without it, durable queues fail.
    pub queue_storage: Option<Arc<dyn QueueStorage>>,
    /// How this engine's queue workers take and settle items.
    pub queue: QueueOptions,
}

impl WorkflowEngine {
    /// The durable engine on a sharding runtime with a message storage: executions live in
    /// that storage and run on the runner that owns their shard. Every runner (and every
    /// client-only process that executes or completes workflows) makes one; runners register
    /// the bodies they run.
    ///
    /// # Errors
    ///
    /// [`WorkflowError::Invalid`] when the runtime has no message storage or already has an
    /// engine.
    ///
    /// # Example
    ///
    /// One runner on a SQLite file; with several runners on PostgreSQL or MySQL
    /// (`Sharding::member`) the same code runs each execution on the owner of its shard:
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use cluster_core::ShardingConfig;
    /// use cluster_sharding::Sharding;
    /// use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions};
    /// use cluster_workflow::{Workflow, WorkflowEngine};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct Order { id: String, amount: u64 }
    ///
    /// struct PlaceOrder;
    /// impl Workflow for PlaceOrder {
    ///     const NAME: &'static str = "PlaceOrder";
    ///     type Payload = Order;
    ///     type Success = String;
    ///     type Error = String;
    ///     fn idempotency_key(order: &Order) -> String { order.id.clone() }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let path = std::env::temp_dir().join(format!("doc-workflow-{}.db", std::process::id()));
    /// let messages = SqliteMessageStorage::open(&path, SqliteOptions::default()).await?;
    /// let sharding =
    ///     Sharding::standalone(ShardingConfig::default(), Arc::new(messages)).start().await?;
    /// let engine = WorkflowEngine::cluster(&sharding)?;
    /// PlaceOrder::register(&engine, |ctx, order| async move {
    ///     // Runs once; a replay of the execution reads its stored result.
    ///     let charge: String = ctx
    ///         .activity("charge", async |_| Ok::<_, String>(format!("charged {}", order.amount)))
    ///         .await?;
    ///     Ok(charge)
    /// })?;
    ///
    /// let order = || Order { id: "order-1".into(), amount: 30 };
    /// assert_eq!(engine.execute::<PlaceOrder>(order()).await?, "charged 30");
    /// // The same idempotency key: the stored result of the first execution.
    /// assert_eq!(engine.execute::<PlaceOrder>(order()).await?, "charged 30");
    ///
    /// engine.shutdown().await;
    /// sharding.shutdown().await;
    /// # for suffix in ["", "-wal", "-shm"] {
    /// #     let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    /// # }
    /// # Ok(())
    /// # }
    /// ```
    pub fn cluster(sharding: &Sharding) -> Result<WorkflowEngine, WorkflowError> {
        WorkflowEngine::cluster_with(sharding, ClusterOptions::default())
    }

    /// [`WorkflowEngine::cluster`] with `options`: the queue storage that durable queues need,
    /// and how the queue workers registered here work.
    ///
    /// # Errors
    ///
    /// As [`WorkflowEngine::cluster`].
    pub fn cluster_with(
        sharding: &Sharding,
        options: ClusterOptions,
    ) -> Result<WorkflowEngine, WorkflowError> {
        let backend = ClusterEngine::attach(sharding, options)?;
        Ok(WorkflowEngine { backend, _runtime: Some(sharding.clone()) })
    }
}

impl ClusterEngine {
    /// The cluster engine of `sharding`, its clock entity registered: what
    /// [`WorkflowEngine::cluster_with`] runs on.
    fn attach(
        sharding: &Sharding,
        options: ClusterOptions,
    ) -> Result<Arc<ClusterEngine>, WorkflowError> {
        let Some(storage) = sharding.message_storage().cloned() else {
            return Err(WorkflowError::Invalid(
                "the cluster workflow engine needs a runtime with a message storage".into(),
            ));
        };
        let engine = Arc::new_cyclic(|me| ClusterEngine {
            me: me.clone(),
            sharding: sharding.downgrade(),
            storage,
            registrations: Mutex::new(BTreeMap::new()),
            definitions: Mutex::new(BTreeMap::new()),
            activations: Mutex::new(BTreeMap::new()),
            queues: QueueWorkers::new(options.queue_storage, options.queue),
        });
        // The entities get the engine from their factory: it lives as long as their runtime.
        let clock_engine = Arc::clone(&engine);
        let registered = sharding
            .entity()
            .named(EntityType::from(CLOCK_ENTITY))
            .options(entity_options())
            .factory(move |context| ClockEntity::new(context, Arc::clone(&clock_engine)))
            .register();
        match registered {
            Ok(()) => {
                engine.start_retention(sharding)?;
                Ok(engine)
            }
            Err(RegisterError::AlreadyRegistered(_)) => {
                Err(WorkflowError::Invalid("the runtime already has a workflow engine".into()))
            }
            Err(error) => Err(WorkflowError::Register {
                entity_type: CLOCK_ENTITY.to_owned(),
                source: Arc::new(error),
            }),
        }
    }
}

impl ClusterEngine {
    /// Registers the workflow retention singleton on a runner whose configuration sets
    /// `workflow_retention` (see `retention`); warns on a runner whose tables on PostgreSQL or
    /// MySQL would keep every execution forever. A client does neither.
    fn start_retention(&self, sharding: &Sharding) -> Result<(), WorkflowError> {
        if !sharding.is_runner() {
            return Ok(());
        }
        let Some(retention) = sharding.config().workflow_retention else {
            let backend = self.storage.backend_name();
            if matches!(backend, "postgres" | "mysql") {
                tracing::warn!(
                    backend,
                    "workflow_retention is not set: completed workflow executions are kept \
                     forever and the tables grow without bound; set WORKFLOW_RETENTION (30 days, \
                     say, longer than your longest workflow)"
                );
            }
            return Ok(());
        };
        let engine = self.me.clone();
        sharding
            .register_singleton(
                retention::WORKFLOW_RETENTION,
                cluster_sharding::SingletonOptions::default(),
                move |context| retention::run(engine.clone(), retention, context),
            )
            .map_err(|error| WorkflowError::Register {
                entity_type: retention::WORKFLOW_RETENTION.to_owned(),
                source: Arc::new(error),
            })
    }
}

fn entity_options() -> EntityOptions {
    EntityOptions {
        // A run without a result (a defect with `capture_defects` off) panics on purpose to be
        // run again: the reference's fatal defects.
        defects: Some(cluster_sharding::Defects::Replay),
        max_idle_time: Some(Some(MAX_IDLE)),
        concurrency: Some(Capacity::Bounded(
            NonZeroU32::new(CONCURRENCY).unwrap_or(NonZeroU32::MIN),
        )),
        ..EntityOptions::default()
    }
}

fn cluster_error<E: std::fmt::Debug>(error: CallError<E>) -> WorkflowError {
    match error {
        CallError::Cluster(error) => {
            WorkflowError::cluster_from("a call to a workflow entity failed", error)
        }
        other => WorkflowError::cluster(format!("a call to a workflow entity failed: {other:?}")),
    }
}

/// The exit of a request whose final reply is a defect (`CallError::Defect`, with the
/// defect's JSON): its result could not be stored (a value over the storage's limit,
/// `ReplyNotStored`) or read. No rerun changes a final reply, so it is the step's outcome.
fn defect_exit(defect: String) -> Exit {
    let defect = RawJson::from_json(defect.clone())
        .or_else(|_| RawJson::encode(&defect))
        .unwrap_or_else(|_| RawJson::null());
    Exit::die(defect)
}

fn storage_error(error: cluster_core::StorageError) -> WorkflowError {
    WorkflowError::cluster_from("a storage operation failed", error)
}

/// The reference's storage-read retry: 3 retries, 250 ms growing ×2.
async fn with_retries<T, F, Fut>(mut attempt: F) -> Result<T, WorkflowError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, WorkflowError>>,
{
    let mut backoff = Backoff::doubling(Duration::from_millis(250), Duration::from_secs(1));
    for _ in 0..3 {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) => {
                tracing::debug!(%error, "workflow storage read failed, retrying");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
    attempt().await
}

/// This runner stops serving the execution (it shuts down): the request is left stored for
/// the next owner instead of being answered (the reference's `ClusterAbandon`).
#[derive(Debug)]
pub(crate) struct Abandoned;

/// Ends the handler of `context` without a reply: its request stays stored for the next owner
/// (the runtime sees an interrupt while it no longer serves the shard).
async fn abandon(context: &RequestContext) -> Never {
    tracing::debug!(request_id = %context.request_id(), "workflow request left for the next owner");
    context.cancellation().cancel();
    std::future::pending().await
}

impl ClusterEngine {
    /// The reference's `ensureSuccess` (4.1.0): retried without end on
    /// `min(200 ms × 1.5ⁿ, 1 min)`, except that a runner that stops gives up at once
    /// ([`Abandoned`]) instead of holding its shutdown until the termination timeout
    /// (new in effect 4.1.0).
    async fn ensure<F, Fut>(&self, what: &str, mut attempt: F) -> Result<(), Abandoned>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), WorkflowError>>,
    {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(60), 3, 2);
        loop {
            if self.is_shutdown() {
                return Err(Abandoned);
            }
            match attempt().await {
                Ok(()) => return Ok(()),
                Err(error) => tracing::warn!(%error, what, "workflow wake failed, retrying"),
            }
            let delay = backoff.next_delay();
            self.pause(delay).await?;
        }
    }

    /// Sleeps `delay` in slices, to notice a shutdown ([`Abandoned`]).
    async fn pause(&self, delay: Duration) -> Result<(), Abandoned> {
        // A retry schedule's delay may be past what an instant holds: capped, it is never.
        let now = tokio::time::Instant::now();
        let deadline =
            now.checked_add(delay).unwrap_or_else(|| now + cluster_core::clock::FAR_FUTURE);
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(());
            }
            if self.is_shutdown() {
                return Err(Abandoned);
            }
            tokio::time::sleep((deadline - now).min(Duration::from_millis(100))).await;
        }
    }
}

impl ClusterEngine {
    fn arc(&self) -> Option<Arc<ClusterEngine>> {
        self.me.upgrade()
    }

    fn group(&self, workflow: &str, execution_id: &ExecutionId) -> ShardGroup {
        let shard_group =
            lock(&self.definitions).get(workflow).and_then(|options| options.shard_group);
        shard_group.map_or_else(ShardGroup::default_group, |group| group(execution_id.as_str()))
    }

    fn entity_type(workflow: &str) -> EntityType {
        EntityType::from(format!("Workflow/{workflow}"))
    }

    /// The runtime, unless every handle on it was dropped (the engine goes with it).
    fn sharding(&self) -> Result<Sharding, WorkflowError> {
        self.sharding.upgrade().ok_or_else(|| {
            WorkflowError::cluster("the cluster runtime is gone: every handle on it was dropped")
        })
    }

    /// Whether the runtime shuts down, or is gone.
    fn is_shutdown(&self) -> bool {
        self.sharding.upgrade().is_none_or(|sharding| sharding.is_shutdown())
    }

    fn address(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
    ) -> Result<EntityAddress, WorkflowError> {
        Ok(self.client(workflow, execution_id)?.address().clone())
    }

    fn client(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
    ) -> Result<EntityClient<WorkflowEntity>, WorkflowError> {
        let group = self.group(workflow, execution_id);
        Ok(self
            .sharding()?
            .entity::<WorkflowEntity>()
            .named(Self::entity_type(workflow))
            .client_in(&group, execution_id.as_str()))
    }

    fn clock_client(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
    ) -> Result<EntityClient<ClockEntity>, WorkflowError> {
        let group = self.group(workflow, execution_id);
        Ok(self
            .sharding()?
            .entity::<ClockEntity>()
            .named(EntityType::from(CLOCK_ENTITY))
            .client_in(&group, execution_id.as_str()))
    }

    fn activation(&self, execution_id: &ExecutionId) -> Option<Arc<Activation>> {
        lock(&self.activations).get(execution_id).and_then(Weak::upgrade)
    }

    /// The stored request id of `tag` with `key` for the execution.
    async fn request_id(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
        tag: &str,
        key: &str,
    ) -> Result<Option<Snowflake>, WorkflowError> {
        let key = primary_key(&self.address(workflow, execution_id)?, tag, key);
        with_retries(|| async {
            self.storage.request_id_for_primary_key(&key).await.map_err(storage_error)
        })
        .await
    }

    /// The latest final reply of a request: its id and exit.
    async fn final_reply(
        &self,
        request_id: Snowflake,
    ) -> Result<Option<(Snowflake, Exit)>, WorkflowError> {
        let replies = with_retries(|| async {
            self.storage.replies_for(&[request_id]).await.map_err(storage_error)
        })
        .await?;
        Ok(replies.into_iter().rev().find_map(|reply| match reply {
            Reply::WithExit(with_exit) => Some((with_exit.id, with_exit.exit)),
            Reply::Chunk(_) => None,
        }))
    }

    /// The `run` request of an execution and its latest result.
    async fn run_result(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
    ) -> Result<Option<(Snowflake, Option<(Snowflake, WorkflowResult)>)>, WorkflowError> {
        let Some(request_id) = self.request_id(workflow, execution_id, RunRpc::TAG, "").await?
        else {
            return Ok(None);
        };
        let result = match self.final_reply(request_id).await? {
            Some((reply_id, Exit::Success(value))) => {
                let result: ResultJson = value.decode().map_err(WorkflowError::Malformed)?;
                Some((reply_id, result.0))
            }
            // A final reply that is a failure (its result could not be stored, as a value
            // over the storage's limit): the execution is over, with that defect.
            Some((reply_id, Exit::Failure(cause))) => {
                Some((reply_id, WorkflowResult::Complete(Exit::Failure(cause))))
            }
            None => None,
        };
        Ok(Some((request_id, result)))
    }

    /// A completion of deferred `name`: the stored reply, or (effect 4.1.0) the payload of a saved
    /// request not yet processed, since the first completion saved is final.
    async fn stored_deferred(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
        name: &str,
    ) -> Result<Option<Exit>, WorkflowError> {
        let Some(request_id) =
            self.request_id(workflow, execution_id, DeferredRpc::TAG, name).await?
        else {
            return Ok(None);
        };
        if let Some(exit) = self.deferred_reply(request_id).await? {
            return Ok(Some(exit));
        }
        let now = self.sharding()?.clock().now();
        let unprocessed = with_retries(|| async {
            self.storage.unprocessed_messages_by_id(&[request_id], now).await.map_err(storage_error)
        })
        .await?;
        for message in unprocessed.messages {
            if let Envelope::Request(request) = message.envelope
                && let Ok(deferred) = request.payload.decode::<DeferredRpc>()
            {
                return Ok(Some(deferred.exit.0));
            }
        }
        // Processed in between: read the reply again.
        self.deferred_reply(request_id).await
    }

    async fn deferred_reply(&self, request_id: Snowflake) -> Result<Option<Exit>, WorkflowError> {
        match self.final_reply(request_id).await? {
            Some((_, Exit::Success(value))) => value
                .decode::<ExitJson>()
                .map(|exit| Some(exit.0))
                .map_err(WorkflowError::Malformed),
            // The completion was processed but its reply could not be stored (a value at the
            // storage's limit once wrapped in the reply): the awaiting step gets the defect.
            Some((_, failure @ Exit::Failure(_))) => Ok(Some(failure)),
            None => Ok(None),
        }
    }

    /// Resets a suspended execution's `run` so that it replays (not a `failed` one on an
    /// automatic wake). A run without a reply is left alone: it is in progress, and reads the
    /// completion that woke it.
    async fn resume_execution(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
        mode: ResumeMode,
    ) -> Result<(), WorkflowError> {
        let Some((request_id, result)) = self.run_result(workflow, execution_id).await? else {
            return Ok(());
        };
        match result {
            Some((reply_id, WorkflowResult::Suspended { failed, .. })) => {
                if failed && mode == ResumeMode::Automatic {
                    return Ok(());
                }
                tracing::debug!(workflow, %execution_id, ?mode, "workflow resumed");
                self.sharding()?.reset(request_id, Some(reply_id)).await.map_err(|error| {
                    WorkflowError::cluster_from("failed to reset the workflow run", error)
                })
            }
            Some((_, WorkflowResult::Complete(_))) | None => Ok(()),
        }
    }

    /// Wakes a child's parent (the reference's `sendResumeParent`).
    async fn resume_parent(
        &self,
        parent: &ParentJson,
        child: &ExecutionId,
    ) -> Result<(), WorkflowError> {
        let parent_id = ExecutionId::from_raw(parent.execution_id.as_str());
        let existing = self
            .request_id(&parent.workflow_name, &parent_id, ResumeRpc::TAG, child.as_str())
            .await?;
        match existing {
            None => self
                .client(&parent.workflow_name, &parent_id)?
                .discard(ResumeRpc { child_execution_id: Some(child.as_str().to_owned()) })
                .await
                .map_err(cluster_error),
            Some(request_id) => {
                if self.final_reply(request_id).await?.is_some() {
                    self.sharding()?.reset(request_id, None).await.map_err(|error| {
                        WorkflowError::cluster_from("failed to reset the parent's resume", error)
                    })?;
                }
                Ok(())
            }
        }
    }

    /// Removes every scheduled clock of an execution.
    async fn clear_clocks(&self, workflow: &str, execution_id: &ExecutionId) {
        let Ok(client) = self.clock_client(workflow, execution_id) else { return };
        let address = client.address().clone();
        if let Err(error) = self.storage.clear_address(&address).await {
            tracing::warn!(%error, %execution_id, "could not clear the workflow's clocks");
        }
    }
}

#[cfg(test)]
mod tests {
    use cluster_core::{ShardingConfig, SystemClock};
    use cluster_storage_sql::{
        SqlStorageOptions, SqliteMessageStorage, SqliteOptions, TablePrefix,
    };

    use super::requests::{ActivityRpc, ClockRpc};
    use super::*;
    use crate::engine::{Backend, Parent};
    use crate::id::Token;
    use cluster_core::Timestamp;
    use cluster_testkit::databases::TestDatabase;

    /// One engine per runtime: a second one would register the same entity types, so it is
    /// refused with a typed error, and the first keeps working.
    #[tokio::test]
    async fn a_second_engine_on_one_runtime_is_refused() {
        let database = TestDatabase::sqlite("workflow-second");
        let sharding = standalone(&database).await;
        let first = WorkflowEngine::cluster(&sharding).unwrap();
        let second = WorkflowEngine::cluster(&sharding).unwrap_err();
        assert!(
            matches!(&second, WorkflowError::Invalid(message) if message.contains("already has")),
            "{second:?}"
        );
        drop(first);
        sharding.shutdown().await;
    }

    /// A runner on `database` that owns every shard.
    async fn standalone(database: &TestDatabase) -> Sharding {
        let config = ShardingConfig::default();
        let (messages, _) = database.open(&config).await.unwrap();
        Sharding::standalone(config, messages).start().await.unwrap()
    }

    /// How long a dropped runtime may take to go.
    const DROP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

    /// The runtime holds the engine in its entities' factories, so the engine holds the runtime
    /// weakly: once the handles are dropped, the runtime goes, with its storage's connections.
    /// (With a strong handle the two kept each other alive, and `cargo test`'s MySQL tests ran
    /// the server out of connections.)
    #[tokio::test]
    async fn the_runtime_goes_with_its_last_handle_and_the_engines() {
        let database = TestDatabase::sqlite("workflow-dropped");
        let sharding = standalone(&database).await;
        let engine = WorkflowEngine::cluster(&sharding).unwrap();
        let weak = sharding.downgrade();
        sharding.shutdown().await;
        drop(sharding);
        assert!(weak.upgrade().is_some(), "the engine's handle keeps the runtime alive");
        drop(engine);
        let dropped = || weak.upgrade().is_none();
        cluster_testkit::wait::eventually_within("the runtime is dropped", DROP_DEADLINE, dropped)
            .await;
    }

    /// New in effect 4.1.0 (`deferredResult` reads an unprocessed completion): a completion saved
    /// and not yet processed is already the deferred's result, and the first one saved wins. On
    /// 4.0.6 the reader found nothing until the owner processed it.
    #[tokio::test]
    async fn a_saved_but_unprocessed_completion_is_the_deferreds_result() {
        let clock: Arc<dyn cluster_core::Clock> = Arc::new(SystemClock);
        let config = ShardingConfig { runner_address: None, ..ShardingConfig::default() };
        let path =
            std::env::temp_dir().join(format!("workflow-unprocessed-{}.db", std::process::id()));
        let options =
            SqliteOptions::new(SqlStorageOptions::from_config(&config, TablePrefix::default()));
        let storage = Arc::new(SqliteMessageStorage::open(&path, options).await.unwrap());
        // A client-only process: nobody processes the completions it saves.
        let sharding = Sharding::client_only(config, storage).clock(clock).start().await.unwrap();
        let cluster = ClusterEngine::attach(&sharding, ClusterOptions::default()).unwrap();
        let engine = WorkflowEngine {
            backend: Arc::clone(&cluster) as Arc<dyn Backend>,
            _runtime: Some(sharding.clone()),
        };
        let execution_id = ExecutionId::derive("Gated", "pending");
        let token = |_: ()| Token {
            workflow: "Gated".into(),
            execution_id: execution_id.clone(),
            deferred: "Gate".into(),
        };
        // Through the engine's own completion: the execution was never started.
        for value in ["first", "second"] {
            let exit = Exit::Success(RawJson::encode(value).unwrap());
            cluster.complete(None, token(()), exit).await.unwrap();
        }
        let refused = engine.complete(&token(()), Ok::<&str, Never>("third")).await;
        assert!(matches!(refused, Err(WorkflowError::NoSuchExecution { .. })), "{refused:?}");
        let stored = cluster.stored_deferred("Gated", &execution_id, "Gate").await.unwrap();
        assert_eq!(stored, Some(Exit::Success(RawJson::encode("first").unwrap())));
        assert_eq!(cluster.stored_deferred("Gated", &execution_id, "Other").await.unwrap(), None);
        drop((cluster, engine));
        sharding.shutdown().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }

    #[test]
    fn requests_use_the_reference_json() {
        let payload = RawJson::encode(&serde_json::json!({ "to": "a" })).unwrap();
        let parent = Parent {
            workflow: "Parent",
            execution_id: ExecutionId::from_raw("p1"),
            detached: false,
        };
        let run = RunRpc::new(&payload, Some(&parent)).unwrap();
        let expected = serde_json::json!({
            "to": "a",
            "~effect/cluster/ClusterWorkflowEngine/payloadParentKey": {
                "workflowName": "Parent",
                "executionId": "p1",
            },
        });
        assert_eq!(serde_json::to_value(&run).unwrap(), expected);
        let (payload, parent) = run.split();
        assert_eq!(payload.json(), Some(r#"{"to":"a"}"#));
        assert_eq!(parent.map(|parent| parent.execution_id), Some("p1".to_owned()));
        assert!(RunRpc::new(&RawJson::encode(&5).unwrap(), None).is_err(), "not an object");
        let activity =
            ActivityRpc { name: "SendEmail".into(), attempt: 3, with_transaction: false };
        assert_eq!(
            serde_json::to_string(&activity).unwrap(),
            r#"{"name":"SendEmail","attempt":3,"withTransaction":false}"#
        );
        assert_eq!(activity.primary_key().as_deref(), Some("SendEmail/3"));
        let old: ActivityRpc = serde_json::from_str(r#"{"name":"a","attempt":1}"#).unwrap();
        assert!(!old.with_transaction, "withTransaction decodes to false by default");
        let deferred = DeferredRpc { name: "Gate".into(), exit: ExitJson(Exit::void()) };
        assert_eq!(
            serde_json::to_string(&deferred).unwrap(),
            r#"{"name":"Gate","exit":{"_tag":"Success","value":null}}"#
        );
        let resume: ResumeRpc = serde_json::from_str("{}").unwrap();
        assert_eq!(resume.primary_key().as_deref(), Some(""), "older envelopes are empty");
        let clock = ClockRpc { name: "nap".into(), workflow_name: "W".into(), wake_up: 10_001 };
        assert_eq!(
            serde_json::to_string(&clock).unwrap(),
            r#"{"name":"nap","workflowName":"W","wakeUp":10001}"#
        );
        assert_eq!(clock.deliver_at(), Some(Timestamp::from_unix_millis(10_001)));
        let result = ResultJson(WorkflowResult::suspended());
        assert_eq!(serde_json::to_string(&result).unwrap(), r#"{"_tag":"Suspended"}"#);
    }
}
