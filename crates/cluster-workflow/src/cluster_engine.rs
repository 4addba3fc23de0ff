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

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use cluster_core::backoff::Backoff;
use cluster_core::config::Capacity;
use cluster_core::envelope::{Envelope, Exit, RawJson, Reply, primary_key};
use cluster_core::future::BoxFuture;
use cluster_core::queue_storage::QueueStorage;
use cluster_core::storage::MessageStorage;
use cluster_core::sync::lock;
use cluster_core::{DecodeError, EntityAddress, EntityType, ShardGroup, Snowflake, Timestamp};
use cluster_sharding::{
    CallError, Entity, EntityClient, EntityContext, EntityOptions, Protocol, RegisterError,
    RequestContext, Rpc, Sharding, SharedHandler, TransactionSlot, Uninterruptible,
};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use tokio::sync::{oneshot, watch};

use crate::context::{Never, WorkflowContext};
use crate::definition::WorkflowOptions;
use crate::engine::QueueWorker;
use crate::engine::{
    ActivityBody, ActivityStep, Backend, Ending, Parent, Registration, ResumeMode, RunOutcome,
    Scope, WorkflowEngine, WorkflowError, close_run, ending, retain_scope, run_outcome,
};
use crate::id::{ExecutionId, Token};
use crate::queue::{QueueOptions, QueueWorkers};
use crate::result::WorkflowResult;
use crate::run::{Awaits, BodyEnd, ChildLink, Run, RunKind, RunOptions, drive};

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

// ----------------------------------------------------------------------------------------
// The requests, in the reference's JSON forms.

/// A [`WorkflowResult`] as a reply value.
#[derive(Clone, Debug)]
pub(crate) struct ResultJson(WorkflowResult);

/// An [`Exit`] as a value.
#[derive(Clone, Debug)]
pub(crate) struct ExitJson(Exit);

/// Serde through a type's own JSON text (embedded as is, not quoted).
macro_rules! json_text_serde {
    ($wrapper:ident, $to:expr, $from:expr) => {
        impl Serialize for $wrapper {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let raw = RawValue::from_string($to(&self.0)).map_err(serde::ser::Error::custom)?;
                raw.serialize(serializer)
            }
        }

        impl<'de> Deserialize<'de> for $wrapper {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let raw = Box::<RawValue>::deserialize(deserializer)?;
                $from(raw.get()).map($wrapper).map_err(D::Error::custom)
            }
        }
    };
}

json_text_serde!(ResultJson, WorkflowResult::to_json, WorkflowResult::from_json);
json_text_serde!(
    ExitJson,
    <Exit as cluster_core::encoded::JsonForm>::to_json,
    <Exit as cluster_core::encoded::JsonForm>::from_json
);

/// The parent of a child, as stored in the child's `run` payload.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ParentJson {
    workflow_name: String,
    execution_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    detached: Option<bool>,
}

/// `run`: the workflow's payload fields, and the parent under [`PARENT_KEY`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct RunRpc(serde_json::Map<String, serde_json::Value>);

impl RunRpc {
    fn new(payload: &RawJson, parent: Option<&Parent>) -> Result<RunRpc, WorkflowError> {
        let fields: serde_json::Map<String, serde_json::Value> =
            payload.decode().map_err(|_| {
                WorkflowError::Malformed(DecodeError::new(
                    "workflow payload",
                    "a workflow payload must encode as a JSON object for the cluster engine",
                ))
            })?;
        let mut fields = fields;
        if let Some(parent) = parent {
            let parent = ParentJson {
                workflow_name: parent.workflow.to_owned(),
                execution_id: parent.execution_id.as_str().to_owned(),
                detached: parent.detached.then_some(true),
            };
            let parent = serde_json::to_value(parent).map_err(|error| {
                WorkflowError::Malformed(DecodeError::new("parent", error.to_string()))
            })?;
            fields.insert(PARENT_KEY.to_owned(), parent);
        }
        Ok(RunRpc(fields))
    }

    /// The workflow's payload and the parent.
    fn split(mut self) -> (RawJson, Option<ParentJson>) {
        let parent =
            self.0.remove(PARENT_KEY).and_then(|parent| serde_json::from_value(parent).ok());
        let payload = RawJson::encode(&self.0).unwrap_or_else(|_| RawJson::empty_object());
        (payload, parent)
    }
}

impl Rpc for RunRpc {
    const TAG: &'static str = "run";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Both;
    type Success = ResultJson;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(String::new())
    }
}

/// `activity`: one attempt of an activity.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ActivityRpc {
    name: String,
    attempt: u32,
    #[serde(default)]
    with_transaction: bool,
}

impl Rpc for ActivityRpc {
    const TAG: &'static str = "activity";
    const PERSISTED: bool = true;
    // A caller that goes away (a race's loser, a run cut off) is seen by the handler as a
    // closed channel, which stores `Suspended` so that the activity runs again when called.
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Client;
    // `withTransaction` in the payload puts the handler (which hands the body the
    // transaction) and the saved result in one storage transaction, as the reference's
    // `ClusterSchema.Dynamic` annotation of its `activity` request does.
    const WITH_TRANSACTION_PER_REQUEST: bool = true;
    type Success = ResultJson;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(format!("{}/{}", self.name, self.attempt))
    }

    fn with_transaction(&self) -> bool {
        self.with_transaction
    }
}

/// `deferred`: a completion of a deferred.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct DeferredRpc {
    name: String,
    exit: ExitJson,
}

impl Rpc for DeferredRpc {
    const TAG: &'static str = "deferred";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Both;
    type Success = ExitJson;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.name.clone())
    }
}

/// `resume`: a wake, from a child (keyed by its execution id) or without one.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ResumeRpc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    child_execution_id: Option<String>,
}

impl Rpc for ResumeRpc {
    const TAG: &'static str = "resume";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Server;
    type Success = ();
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.child_execution_id.clone().unwrap_or_default())
    }
}

/// The clock entity's `run`: wake deferred `DurableClock/<name>` at `wake_up` (epoch ms).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ClockRpc {
    name: String,
    workflow_name: String,
    wake_up: i64,
}

impl Rpc for ClockRpc {
    const TAG: &'static str = "run";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Both;
    type Success = ();
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.name.clone())
    }

    fn deliver_at(&self) -> Option<Timestamp> {
        Some(Timestamp::from_unix_millis(self.wake_up))
    }
}

// ----------------------------------------------------------------------------------------
// The engine.

/// The cluster engine's shared state, attached to its runtime as an extension.
pub(crate) struct ClusterEngine {
    me: Weak<ClusterEngine>,
    sharding: Sharding,
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
    /// (`ShardingBuilder::runners`) the same code runs each execution on the owner of its shard:
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
    ///     Sharding::builder(ShardingConfig::default()).messages(Arc::new(messages)).start().await?;
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
        Ok(WorkflowEngine { backend })
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
            sharding: sharding.clone(),
            storage,
            registrations: Mutex::new(BTreeMap::new()),
            definitions: Mutex::new(BTreeMap::new()),
            activations: Mutex::new(BTreeMap::new()),
            queues: QueueWorkers::new(options.queue_storage, options.queue),
        });
        // The entities get the engine from their factory: it lives as long as their runtime.
        let clock_engine = Arc::clone(&engine);
        let registered = sharding.register_as_with(
            EntityType::from(CLOCK_ENTITY),
            entity_options(),
            move |context| ClockEntity::new(context, Arc::clone(&clock_engine)),
        );
        match registered {
            Ok(()) => Ok(engine),
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
        let schedule = crate::definition::RetrySchedule {
            initial: Duration::from_millis(200),
            factor: 1.5,
            max: Duration::from_secs(60),
            attempts: None,
        };
        let mut step = 0;
        loop {
            if self.sharding.is_shutdown() {
                return Err(Abandoned);
            }
            match attempt().await {
                Ok(()) => return Ok(()),
                Err(error) => tracing::warn!(%error, what, "workflow wake failed, retrying"),
            }
            let delay = schedule.delay(step).unwrap_or(schedule.max);
            step += 1;
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
            if self.sharding.is_shutdown() {
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

    fn address(&self, workflow: &str, execution_id: &ExecutionId) -> EntityAddress {
        self.client(workflow, execution_id).address().clone()
    }

    fn client(&self, workflow: &str, execution_id: &ExecutionId) -> EntityClient<WorkflowEntity> {
        let group = self.group(workflow, execution_id);
        self.sharding.client_in::<WorkflowEntity>(
            Self::entity_type(workflow),
            &group,
            execution_id.as_str(),
        )
    }

    fn clock_client(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
    ) -> EntityClient<ClockEntity> {
        let group = self.group(workflow, execution_id);
        self.sharding.client_in::<ClockEntity>(
            EntityType::from(CLOCK_ENTITY),
            &group,
            execution_id.as_str(),
        )
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
        let key = primary_key(&self.address(workflow, execution_id), tag, key);
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
        let now = self.sharding.clock().now();
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
                if self.sharding.reset(request_id, Some(reply_id)).await {
                    return Ok(());
                }
                Err(WorkflowError::cluster("failed to reset the workflow run"))
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
                .client(&parent.workflow_name, &parent_id)
                .discard(ResumeRpc { child_execution_id: Some(child.as_str().to_owned()) })
                .await
                .map_err(cluster_error),
            Some(request_id) => {
                if self.final_reply(request_id).await?.is_some()
                    && !self.sharding.reset(request_id, None).await
                {
                    return Err(WorkflowError::cluster("failed to reset the parent's resume"));
                }
                Ok(())
            }
        }
    }

    /// Removes every scheduled clock of an execution.
    async fn clear_clocks(&self, workflow: &str, execution_id: &ExecutionId) {
        let address = self.clock_client(workflow, execution_id).address().clone();
        if let Err(error) = self.storage.clear_address(&address).await {
            tracing::warn!(%error, %execution_id, "could not clear the workflow's clocks");
        }
    }
}

// ----------------------------------------------------------------------------------------
// Activations: one lifetime of an execution's entity on this runner.

/// The channel a caller hands to the `activity` handler: the handler sends back where the
/// activity's result goes once the caller has run it, and the request's storage transaction.
type ActivityGo = oneshot::Sender<ActivityStart>;

/// The `activity` handler's go to the caller that runs the body.
struct ActivityStart {
    /// Where the body's result goes.
    done: oneshot::Sender<WorkflowResult>,
    /// The storage transaction the result is saved in, for a transactional activity.
    transaction: Option<TransactionSlot>,
}

#[derive(Default)]
struct ActivationState {
    /// Deferred completions seen by this activation.
    results: BTreeMap<String, Exit>,
    /// The run in progress.
    current: Option<Arc<Run>>,
    /// The waits of the current run's activities, kept for the whole run (until the next one
    /// starts), after the activities' own runs are gone: a completion they awaited wakes the
    /// run once it replied.
    activity_awaits: Awaits,
    /// Scopes of runs that suspended (or were cut off), closed when the execution ends.
    retained: Vec<Scope>,
    /// Activities whose callers wait for the handler's go.
    activities: BTreeMap<(String, u32), ActivityGo>,
    /// Activities whose caller went away while they ran.
    aborted: BTreeSet<(String, u32)>,
    /// The stored interrupt signal was loaded.
    loaded: bool,
    /// Deferreds that runs of this activation completed themselves: their completions wake
    /// nothing.
    completed_here: BTreeSet<String>,
    /// A run ended and its reply may not be stored yet (the runtime writes it after the
    /// handler returns, once a lock refresh confirmed the shard): a wake waits for it.
    reply_pending: bool,
}

struct Activation {
    engine: Arc<ClusterEngine>,
    registration: Option<Registration>,
    workflow: String,
    execution_id: ExecutionId,
    state: Mutex<ActivationState>,
    /// Counts finished runs.
    runs: watch::Sender<u64>,
    /// The automatic-wake gate: concurrent automatic wakes merge into one.
    waking: AtomicBool,
}

impl Activation {
    fn state(&self) -> MutexGuard<'_, ActivationState> {
        lock(&self.state)
    }

    /// Loads a stored interrupt signal, so a new owner sees an interrupt stored before it
    /// took over. Retried until storage answers.
    async fn load(&self) {
        if self.state().loaded {
            return;
        }
        let mut backoff = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(10));
        loop {
            match self
                .engine
                .stored_deferred(&self.workflow, &self.execution_id, INTERRUPT_SIGNAL)
                .await
            {
                Ok(signal) => {
                    let mut state = self.state();
                    if let Some(exit) = signal {
                        state.results.entry(INTERRUPT_SIGNAL.to_owned()).or_insert(exit);
                    }
                    state.loaded = true;
                    return;
                }
                Err(error) => {
                    tracing::warn!(%error, execution_id = %self.execution_id, "could not load the interrupt signal, retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    fn interrupt_cached(&self) -> bool {
        self.state().results.contains_key(INTERRUPT_SIGNAL)
    }

    async fn deferred(&self, name: &str) -> Result<Option<Exit>, WorkflowError> {
        if let Some(exit) = self.state().results.get(name).cloned() {
            return Ok(Some(exit));
        }
        self.engine.stored_deferred(&self.workflow, &self.execution_id, name).await
    }

    /// One run of the body (the `run` handler).
    async fn run(self: &Arc<Self>, request: RunRpc) -> Result<WorkflowResult, Abandoned> {
        self.load().await;
        let Some(registration) = self.registration.clone() else {
            return Ok(WorkflowResult::suspended());
        };
        let (payload, parent) = request.split();
        let Some(engine) = self.engine.arc() else { return Err(Abandoned) };
        let options = RunOptions {
            capture_defects: registration.options.capture_defects,
            suspend_on_failure: registration.options.suspend_on_failure,
        };
        let backend: Arc<dyn Backend> = engine;
        let run =
            Run::new(registration.name, self.execution_id.clone(), RunKind::Body, options, backend);
        let mut guard =
            CurrentRun { activation: Arc::clone(self), run: Arc::clone(&run), done: false };
        {
            let mut state = self.state();
            state.current = Some(Arc::clone(&run));
            state.activity_awaits = Awaits::default();
        }
        tracing::debug!(workflow = registration.name, execution_id = %self.execution_id, "workflow run started");
        let context = WorkflowContext::new(Arc::clone(&run));
        let end = drive(&run, (registration.body)(context, payload)).await;
        self.apply_interrupt(&run, &end).await;
        let (outcome, children) = run_outcome(&run, &end);
        // The wakes go out before the scope closes, as in the reference's `onExit`: a runner
        // that gives them up stores no result, so the scope is left to the next owner's replay
        // and the compensations run there only.
        if let Err(Abandoned) = self.wake_linked(&outcome, &children, parent.as_ref()).await {
            tracing::debug!(workflow = registration.name, execution_id = %self.execution_id, "workflow run abandoned before its wakes: its scope is left for the next owner");
            run.update(|state| state.abandoned = true);
            return Err(Abandoned);
        }
        close_run(&run, &outcome, |own| retain_scope(&mut self.state().retained, own)).await;
        guard.done = true;
        drop(guard);
        tracing::debug!(workflow = registration.name, execution_id = %self.execution_id, ?outcome, "workflow run ended");
        match outcome {
            RunOutcome::Result(result) => Ok(result),
            // No result to store: the runtime restarts the entity and runs the request again
            // (the reference's defect restart).
            RunOutcome::NoResult(cause) => {
                std::panic::panic_any(format!("workflow run ended without a result: {cause:?}"))
            }
        }
    }

    /// Interrupts the children an applied interrupt reaches (the interrupt link) and wakes the
    /// parent of a completed child (the reference's `sendResumeParent`).
    async fn wake_linked(
        &self,
        outcome: &RunOutcome,
        children: &[ChildLink],
        parent: Option<&ParentJson>,
    ) -> Result<(), Abandoned> {
        let engine = &self.engine;
        for child in children {
            engine
                .ensure("interrupt a child", || {
                    engine.interrupt_execution(child.workflow, &child.execution_id, false)
                })
                .await?;
        }
        if let (RunOutcome::Result(WorkflowResult::Complete(_)), Some(parent)) = (outcome, parent)
            && parent.detached != Some(true)
        {
            let child = &self.execution_id;
            engine.ensure("wake the parent", || engine.resume_parent(parent, child)).await?;
        }
        Ok(())
    }

    /// Branch B of the reference's `onExit`: a run that suspended (or failed under
    /// `suspend_on_failure`) while an interrupt signal is stored applies the interrupt. An
    /// unsafe interrupt ([`INTERRUPT_UNSAFE`]) is applied however the run ended, as the
    /// in-memory engine does, unless the run was abandoned or broken off (it has no result).
    async fn apply_interrupt(&self, run: &Run, end: &BodyEnd) {
        let Ending { suspended, failed_under_sof } = ending(run, end);
        // Read only when an interrupt is known: an unsafe one always stores the signal too.
        let hard = self.interrupt_cached()
            && {
                let state = run.state();
                !state.abandoned && state.broken.is_none()
            }
            && self.is_stored(INTERRUPT_UNSAFE).await;
        if !(suspended || failed_under_sof || hard) {
            return;
        }
        if hard || self.is_stored(INTERRUPT_SIGNAL).await {
            run.update(|state| {
                state.interrupted = true;
                state.suspended = false;
            });
            self.engine.clear_clocks(&self.workflow, &self.execution_id).await;
        }
    }

    /// Whether deferred `name` is completed (cached or stored); an unreadable storage reads as
    /// not completed.
    async fn is_stored(&self, name: &str) -> bool {
        match self.deferred(name).await {
            Ok(completion) => completion.is_some(),
            Err(error) => {
                tracing::warn!(%error, deferred = name, "could not read an interrupt deferred");
                false
            }
        }
    }

    /// The `deferred` handler: records the completion and wakes the execution.
    async fn deferred_completed(
        self: &Arc<Self>,
        name: String,
        exit: Exit,
    ) -> Result<Exit, Abandoned> {
        self.state().results.insert(name.clone(), exit.clone());
        if name == INTERRUPT_UNSAFE {
            // Stored before its interrupt signal, whose completion wakes the execution.
            return Ok(exit);
        }
        let explicit = name == INTERRUPT_SIGNAL;
        let (current, activity_awaits, completed_here) = {
            let state = self.state();
            let activity_awaits = state.activity_awaits.contains(&name);
            (state.current.clone(), activity_awaits, state.completed_here.contains(&name))
        };
        if completed_here && !explicit {
            // A run of this activation completed it and never waits for it.
            return Ok(exit);
        }
        let mode = if explicit { ResumeMode::Explicit } else { ResumeMode::Automatic };
        match current {
            Some(run) if !explicit && !run.awaits(&name) => {
                if activity_awaits {
                    self.resume_current_run(mode).await?;
                } else if !run.state().completed.contains(&name) {
                    let engine = &self.engine;
                    let (workflow, execution_id) = (&self.workflow, &self.execution_id);
                    engine
                        .ensure("resume", || engine.resume_execution(workflow, execution_id, mode))
                        .await?;
                }
            }
            current => {
                if let Some(run) = current
                    && run.awaits(&name)
                {
                    run.preempt();
                }
                self.resume_current_run(mode).await?;
            }
        }
        Ok(exit)
    }

    /// Waits for the current run's reply, then resets it if it is a suspension. Concurrent
    /// automatic wakes merge; an explicit one is never dropped.
    async fn resume_current_run(self: &Arc<Self>, mode: ResumeMode) -> Result<(), Abandoned> {
        if mode == ResumeMode::Automatic && self.waking.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let mut runs = self.runs.subscribe();
        while self.state().current.is_some() {
            if runs.changed().await.is_err() {
                break;
            }
        }
        // A run that just ended may not have its reply stored yet: the reset waits for it,
        // so that a completion during the suspension's commit still wakes the run. Every wake
        // waits (an interrupt must not read "no reply yet" because an earlier wake is already
        // waiting); the mark is cleared once the reply is seen, unless another run ended since.
        let pending = self.state().reply_pending.then(|| *self.runs.borrow());
        let settled = match pending {
            Some(runs) => self.await_run_reply().await.inspect(|()| {
                let mut state = self.state();
                if state.current.is_none() && *self.runs.borrow() == runs {
                    state.reply_pending = false;
                }
            }),
            None => Ok(()),
        };
        // Released before the reset can start a replay, so that later wakes reach it.
        if mode == ResumeMode::Automatic {
            self.waking.store(false, Ordering::Release);
        }
        settled?;
        let engine = &self.engine;
        let (workflow, execution_id) = (&self.workflow, &self.execution_id);
        engine.ensure("resume", || engine.resume_execution(workflow, execution_id, mode)).await
    }

    /// Waits until the `run` request has a reply, for as long as it takes: the runtime writes
    /// it after the handler returned, and a write can wait for a lock confirmation, retries,
    /// a connection or a group commit (the reference's `waitForRunReply` has no bound either).
    /// Gives up only when the runner shuts down ([`Abandoned`]): the wake's request then
    /// stays stored for the next owner.
    async fn await_run_reply(&self) -> Result<(), Abandoned> {
        let engine = &self.engine;
        let mut backoff = Backoff::doubling(Duration::from_millis(10), Duration::from_secs(1));
        loop {
            match engine.run_result(&self.workflow, &self.execution_id).await {
                Ok(None | Some((_, Some(_)))) | Err(WorkflowError::NoResult(_)) => return Ok(()),
                Ok(Some((_, None))) => {}
                Err(error) => {
                    tracing::warn!(%error, execution_id = %self.execution_id, "could not read the workflow's reply, retrying");
                }
            }
            engine.pause(backoff.next_delay()).await?;
        }
    }
}

/// Marks the activation's current run; a run cut off before it finished (its handler dropped)
/// is treated as superseded: its scope is retained and later closed with success.
struct CurrentRun {
    activation: Arc<Activation>,
    run: Arc<Run>,
    done: bool,
}

impl Drop for CurrentRun {
    fn drop(&mut self) {
        {
            let mut state = self.activation.state();
            let completed = self.run.state().completed.clone();
            state.completed_here.extend(completed);
            state.reply_pending = true;
            if !self.done {
                let (finalizers, abandoned) = {
                    let mut run = self.run.state();
                    (std::mem::take(&mut run.finalizers), run.abandoned)
                };
                state.retained.push((finalizers, abandoned));
            }
            if state.current.as_ref().is_some_and(|current| Arc::ptr_eq(current, &self.run)) {
                state.current = None;
            }
        }
        self.activation.runs.send_modify(|runs| *runs += 1);
    }
}

/// The entity of one execution (`Workflow/<name>`).
pub(crate) struct WorkflowEntity {
    activation: Arc<Activation>,
}

impl Drop for WorkflowEntity {
    fn drop(&mut self) {
        // The activation ends: retained scopes are dropped unrun (abandoned).
        let mut activations = lock(&self.activation.engine.activations);
        if activations
            .get(&self.activation.execution_id)
            .is_some_and(|existing| std::ptr::eq(existing.as_ptr(), Arc::as_ptr(&self.activation)))
        {
            activations.remove(&self.activation.execution_id);
        }
    }
}

impl WorkflowEntity {
    /// The activation of the execution at `context`'s address, on `engine`.
    fn activate(context: &EntityContext, engine: Arc<ClusterEngine>) -> WorkflowEntity {
        let address = context.address();
        let workflow =
            address.entity_type.as_str().strip_prefix("Workflow/").unwrap_or_default().to_owned();
        let registration = lock(&engine.registrations).get(workflow.as_str()).cloned();
        let execution_id = ExecutionId::from_raw(address.entity_id.as_str());
        let activation = Arc::new(Activation {
            engine: Arc::clone(&engine),
            registration,
            workflow,
            execution_id: execution_id.clone(),
            state: Mutex::new(ActivationState::default()),
            runs: watch::Sender::new(0),
            waking: AtomicBool::new(false),
        });
        lock(&engine.activations).insert(execution_id, Arc::downgrade(&activation));
        WorkflowEntity { activation }
    }
}

impl Entity for WorkflowEntity {
    const TYPE: &'static str = "Workflow";

    // Registered as `Workflow/<name>` by the engine, with a factory that hands it the engine.
    const FACTORY_ONLY: bool = true;

    fn create(_: &EntityContext) -> impl std::future::Future<Output = WorkflowEntity> + Send {
        std::future::pending()
    }

    fn protocol(protocol: &mut Protocol<WorkflowEntity>) {
        protocol
            .handle_shared::<RunRpc>()
            .handle_shared::<ActivityRpc>()
            .handle_shared::<DeferredRpc>()
            .handle_shared::<ResumeRpc>();
    }
}

impl SharedHandler<RunRpc> for WorkflowEntity {
    async fn handle(&self, context: &RequestContext, request: RunRpc) -> Result<ResultJson, Never> {
        match self.activation.run(request).await {
            Ok(result) => Ok(ResultJson(result)),
            Err(Abandoned) => Err(abandon(context).await),
        }
    }
}

impl SharedHandler<ActivityRpc> for WorkflowEntity {
    async fn handle(
        &self,
        context: &RequestContext,
        request: ActivityRpc,
    ) -> Result<ResultJson, Never> {
        let key = (request.name, request.attempt);
        let go = {
            let mut state = self.activation.state();
            state.aborted.remove(&key);
            state.activities.remove(&key)
        };
        // No caller waits for it (a race's loser not called again, a redelivery after a
        // restart): answered as suspended, which a later call resets.
        let Some(go) = go else {
            return Ok(ResultJson(settle_transaction(context, WorkflowResult::suspended()).await));
        };
        let (done, result) = oneshot::channel();
        let start = ActivityStart { done, transaction: context.transaction().cloned() };
        if go.send(start).is_ok()
            && let Ok(result) = result.await
        {
            return Ok(ResultJson(settle_transaction(context, result).await));
        }
        self.activation.state().aborted.insert(key);
        Ok(ResultJson(settle_transaction(context, WorkflowResult::suspended()).await))
    }
}

/// Rolls a transactional activity's writes back unless it succeeded: only a success commits
/// with its stored result. A failure or a suspension is saved after the rollback, outside the
/// transaction, so that a failed attempt leaves no writes behind (its retry starts clean) and a
/// suspended body that runs again from its start does not write twice.
async fn settle_transaction(context: &RequestContext, result: WorkflowResult) -> WorkflowResult {
    let committed = matches!(result, WorkflowResult::Complete(Exit::Success(_)));
    if committed {
        return result;
    }
    let Some(slot) = context.transaction() else { return result };
    let transaction = slot.lock().await.take();
    if let Some(transaction) = transaction {
        tracing::debug!(request_id = %context.request_id(), "activity did not succeed: rolling its transaction back");
        if let Err(error) = transaction.rollback().await {
            // Dropped without a commit, the transaction is rolled back anyway.
            tracing::debug!(%error, request_id = %context.request_id(), "activity rollback failed");
        }
    }
    result
}

impl SharedHandler<DeferredRpc> for WorkflowEntity {
    async fn handle(
        &self,
        context: &RequestContext,
        request: DeferredRpc,
    ) -> Result<ExitJson, Never> {
        match self.activation.deferred_completed(request.name, request.exit.0).await {
            Ok(exit) => Ok(ExitJson(exit)),
            Err(Abandoned) => Err(abandon(context).await),
        }
    }
}

impl SharedHandler<ResumeRpc> for WorkflowEntity {
    async fn handle(&self, context: &RequestContext, _: ResumeRpc) -> Result<(), Never> {
        match self.activation.resume_current_run(ResumeMode::Automatic).await {
            Ok(()) => Ok(()),
            Err(Abandoned) => Err(abandon(context).await),
        }
    }
}

/// The clock entity (`Workflow/-/DurableClock`): completes a clock's deferred when its
/// request is delivered, at the wake-up time.
pub(crate) struct ClockEntity {
    engine: Arc<ClusterEngine>,
    execution_id: ExecutionId,
}

impl ClockEntity {
    /// The clock of the execution at `context`'s address, on `engine`.
    fn new(context: &EntityContext, engine: Arc<ClusterEngine>) -> ClockEntity {
        ClockEntity {
            engine,
            execution_id: ExecutionId::from_raw(context.address().entity_id.as_str()),
        }
    }
}

impl Entity for ClockEntity {
    const TYPE: &'static str = CLOCK_ENTITY;

    // Registered by the engine, with a factory that hands it the engine.
    const FACTORY_ONLY: bool = true;

    fn create(_: &EntityContext) -> impl std::future::Future<Output = ClockEntity> + Send {
        std::future::pending()
    }

    fn protocol(protocol: &mut Protocol<ClockEntity>) {
        protocol.handle_shared::<ClockRpc>();
    }
}

impl SharedHandler<ClockRpc> for ClockEntity {
    async fn handle(&self, context: &RequestContext, request: ClockRpc) -> Result<(), Never> {
        let token = Token {
            workflow: request.workflow_name,
            execution_id: self.execution_id.clone(),
            deferred: format!("DurableClock/{}", request.name),
        };
        let engine = &self.engine;
        match engine
            .ensure("wake a clock", || engine.complete(None, token.clone(), Exit::void()))
            .await
        {
            Ok(()) => Ok(()),
            Err(Abandoned) => Err(abandon(context).await),
        }
    }
}

// ----------------------------------------------------------------------------------------
// The engine contract.

impl ClusterEngine {
    async fn complete(
        &self,
        from: Option<&Arc<Run>>,
        token: Token,
        exit: Exit,
    ) -> Result<(), WorkflowError> {
        if let Some(from) = from
            && from.execution_id == token.execution_id
            && token.deferred != INTERRUPT_SIGNAL
        {
            // A run does not wake itself for a completion it made.
            from.update(|state| state.completed.insert(token.deferred.clone()));
        }
        tracing::debug!(workflow = %token.workflow, execution_id = %token.execution_id, deferred = %token.deferred, "deferred completed");
        self.client(&token.workflow, &token.execution_id)
            .discard(DeferredRpc { name: token.deferred, exit: ExitJson(exit) })
            .await
            .map_err(cluster_error)
    }

    async fn interrupt_execution(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
        hard: bool,
    ) -> Result<(), WorkflowError> {
        let Some((request_id, result)) = self.run_result(workflow, execution_id).await? else {
            return Ok(());
        };
        if matches!(result, Some((_, WorkflowResult::Complete(_)))) {
            return Ok(());
        }
        let token = |deferred: &str| Token {
            workflow: workflow.to_owned(),
            execution_id: execution_id.clone(),
            deferred: deferred.to_owned(),
        };
        // The unsafe mark goes first: the signal's wake must find it.
        let signals: &[&str] =
            if hard { &[INTERRUPT_UNSAFE, INTERRUPT_SIGNAL] } else { &[INTERRUPT_SIGNAL] };
        for signal in signals {
            self.complete(None, token(signal), Exit::void()).await?;
            // Stored: an activation of the execution on this runner sees it at its next step
            // without waiting for its delivery (its value is always `void`, so the cache cannot
            // disagree with the first completion stored).
            if let Some(activation) = self.activation(execution_id) {
                activation.state().results.entry((*signal).to_owned()).or_insert_with(Exit::void);
            }
        }
        if hard {
            let address = self.address(workflow, execution_id);
            self.sharding.interrupt_request(&address, request_id).await.map_err(|error| {
                WorkflowError::cluster_from("interrupting a request failed", error)
            })?;
        }
        Ok(())
    }

    /// The request of activity `name`/`attempt` of `run`'s execution, if it was stored.
    async fn activity_request_id(
        &self,
        run: &Run,
        name: &str,
        attempt: u32,
    ) -> Result<Option<Snowflake>, WorkflowError> {
        let key = format!("{name}/{attempt}");
        self.request_id(run.workflow, &run.execution_id, ActivityRpc::TAG, &key).await
    }

    /// The stored result of activity `name`/`attempt`, or a suspension when it has none.
    ///
    /// A stored request without a final reply is waited for: an earlier run cut off while the
    /// activity's result was being written leaves it so, and that result, once stored, is the
    /// activity's (its compensation must be registered). Every stored request gets a final
    /// reply from this owner (`Suspended` when no caller waits), so the wait ends; it gives up
    /// only when the runner shuts down.
    async fn stored_activity_result(
        &self,
        run: &Run,
        name: &str,
        attempt: u32,
    ) -> Result<WorkflowResult, WorkflowError> {
        let Some(request_id) = self.activity_request_id(run, name, attempt).await? else {
            return Ok(WorkflowResult::suspended());
        };
        let mut backoff = Backoff::doubling(Duration::from_millis(10), Duration::from_secs(1));
        let stored = loop {
            if let Some((_, exit)) = self.final_reply(request_id).await? {
                break exit;
            }
            if self.pause(backoff.next_delay()).await.is_err() {
                return Err(WorkflowError::cluster(
                    "the runner stopped while an activity's result was written",
                ));
            }
        };
        match stored {
            Exit::Success(value) => match value.decode() {
                Ok(ResultJson(result @ WorkflowResult::Complete(_))) => Ok(result),
                _ => Ok(WorkflowResult::suspended()),
            },
            // The result could not be stored (`ReplyNotStored`): the defect is the exit.
            failure @ Exit::Failure(_) => Ok(WorkflowResult::Complete(failure)),
        }
    }

    /// Runs activity `name`/`attempt` through its request: the handler gives the go (with the
    /// request's storage transaction for a transactional activity), the body runs here (inside
    /// the run), and the handler stores its result as the reply.
    async fn run_activity<'a>(
        &'a self,
        run: &'a Arc<Run>,
        step: ActivityStep<'a>,
        execute: ActivityBody<'a>,
    ) -> Result<WorkflowResult, WorkflowError> {
        let ActivityStep { name, attempt, transactional } = step;
        let activation = self
            .activation(&run.execution_id)
            .ok_or_else(|| WorkflowError::cluster("the execution is not active on this runner"))?;
        let key = (name.to_owned(), attempt);
        let mut execute = Some(execute);
        loop {
            if !run.state().interrupted && activation.interrupt_cached() {
                // A pending interrupt starts no new activity.
                return self.stored_activity_result(run, name, attempt).await;
            }
            let (go, gone) = oneshot::channel();
            activation.state().activities.insert(key.clone(), go);
            let client = self.client(run.workflow, &run.execution_id);
            let request =
                ActivityRpc { name: name.to_owned(), attempt, with_transaction: transactional };
            let reply = client.send(request);
            tokio::pin!(reply);
            let awaits = activation.state().activity_awaits.clone();
            let activity_run = Run::with_awaits(
                run.workflow,
                run.execution_id.clone(),
                RunKind::Activity(attempt),
                run.options,
                Arc::clone(&run.engine),
                awaits,
            );
            let interrupted = run.state().interrupted;
            activity_run.update(|state| state.interrupted = interrupted);
            // Whether this call's body handed a result (not a suspension) to the handler.
            let handed = AtomicBool::new(false);
            let body = async {
                match (gone.await, execute.take()) {
                    (Ok(ActivityStart { done, transaction }), Some(execute)) => {
                        let result = execute(activity_run, transaction).await;
                        let complete = !result.is_suspended();
                        if done.send(result).is_ok() {
                            handed.store(complete, Ordering::Release);
                        }
                    }
                    _ => std::future::pending::<()>().await,
                }
            };
            let reply = tokio::select! {
                reply = &mut reply => reply,
                () = body => reply.await,
            };
            let reply = match reply {
                Ok(reply) => reply,
                Err(CallError::Defect(defect)) => {
                    tracing::warn!(activity = name, attempt, execution_id = %run.execution_id, %defect, "the activity's result is a defect");
                    ResultJson(WorkflowResult::Complete(defect_exit(defect)))
                }
                Err(error) => return Err(cluster_error(error)),
            };
            let not_run = {
                let mut state = activation.state();
                let waiting = state.activities.remove(&key).is_some();
                waiting || state.aborted.remove(&key)
            };
            match reply.0 {
                WorkflowResult::Suspended { .. } if handed.load(Ordering::Acquire) => {
                    // The body's result was handed over but not stored (its writes failed), and
                    // a redelivery of the request, finding no caller, answered `Suspended`.
                    // Nothing would wake this run: it breaks off, and the replay runs the
                    // activity again (it has no stored result).
                    return Err(WorkflowError::cluster(format!(
                        "the result of activity {name}/{attempt} was not stored"
                    )));
                }
                WorkflowResult::Suspended { .. } if not_run && execute.is_some() => {
                    // A stored suspension of an attempt that did not run here: reset it and
                    // call again.
                    let Some(request_id) = self.activity_request_id(run, name, attempt).await?
                    else {
                        continue;
                    };
                    let sharding = &self.sharding;
                    with_retries(|| async {
                        if sharding.reset(request_id, None).await {
                            Ok(())
                        } else {
                            Err(WorkflowError::cluster("failed to reset an activity"))
                        }
                    })
                    .await?;
                }
                result => return Ok(result),
            }
        }
    }
}

impl Backend for ClusterEngine {
    fn register(&self, registration: Registration) -> Result<(), WorkflowError> {
        {
            let mut registrations = lock(&self.registrations);
            if registrations.contains_key(registration.name) {
                tracing::warn!(
                    workflow = registration.name,
                    "workflow already registered: ignoring the duplicate definition"
                );
                return Err(WorkflowError::Invalid(format!(
                    "workflow {} is already registered",
                    registration.name
                )));
            }
            registrations.insert(registration.name, registration.clone());
        }
        self.define(registration.name, &registration.options);
        let entity_type = Self::entity_type(registration.name);
        let Some(engine) = self.me.upgrade() else {
            return Err(WorkflowError::Invalid("the workflow engine is gone".into()));
        };
        let factory =
            move |context: &EntityContext| WorkflowEntity::activate(context, Arc::clone(&engine));
        self.sharding.register_as_with(entity_type.clone(), entity_options(), factory).map_err(
            |error| WorkflowError::Register {
                entity_type: entity_type.to_string(),
                source: Arc::new(error),
            },
        )
    }

    fn define(&self, workflow: &'static str, options: &WorkflowOptions) {
        lock(&self.definitions).entry(workflow.to_owned()).or_insert_with(|| options.clone());
    }

    fn activity<'a>(
        &'a self,
        run: &'a Arc<Run>,
        step: ActivityStep<'a>,
        execute: ActivityBody<'a>,
    ) -> BoxFuture<'a, Result<WorkflowResult, WorkflowError>> {
        Box::pin(self.run_activity(run, step, execute))
    }

    fn deferred_result<'a>(
        &'a self,
        run: &'a Arc<Run>,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Exit>, WorkflowError>> {
        Box::pin(async move {
            match self.activation(&run.execution_id) {
                Some(activation) => activation.deferred(name).await,
                None => self.stored_deferred(run.workflow, &run.execution_id, name).await,
            }
        })
    }

    fn deferred_done<'a>(
        &'a self,
        from: Option<&'a Arc<Run>>,
        token: Token,
        exit: Exit,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(self.complete(from, token, exit))
    }

    fn schedule_clock<'a>(
        &'a self,
        run: &'a Arc<Run>,
        clock: &'a str,
        duration: Duration,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(async move {
            let now = self.sharding.clock().now().unix_millis();
            #[expect(
                clippy::cast_possible_truncation,
                reason = "a wake-up time in milliseconds fits an i64"
            )]
            let wake_up = now.saturating_add((duration.as_secs_f64() * 1000.0).ceil() as i64);
            let request = ClockRpc {
                name: clock.to_owned(),
                workflow_name: run.workflow.to_owned(),
                wake_up,
            };
            self.clock_client(run.workflow, &run.execution_id)
                .discard(request)
                .await
                .map_err(cluster_error)
        })
    }

    fn execute<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
        payload: RawJson,
        parent: Option<Parent>,
        discard: bool,
    ) -> BoxFuture<'a, Result<Option<WorkflowResult>, WorkflowError>> {
        Box::pin(async move {
            let request = RunRpc::new(&payload, parent.as_ref())?;
            let client = self.client(workflow, execution_id);
            if discard {
                client.discard(request).await.map_err(cluster_error)?;
                return Ok(None);
            }
            match client.send(request).await {
                Ok(result) => Ok(Some(result.0)),
                Err(CallError::Defect(defect)) => {
                    Ok(Some(WorkflowResult::Complete(defect_exit(defect))))
                }
                Err(error) => Err(cluster_error(error)),
            }
        })
    }

    fn execution_exists<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<bool, WorkflowError>> {
        Box::pin(async move {
            let run = self.request_id(workflow, execution_id, RunRpc::TAG, "").await?;
            Ok(run.is_some())
        })
    }

    fn poll<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<Option<WorkflowResult>, WorkflowError>> {
        Box::pin(async move {
            let result = self.run_result(workflow, execution_id).await?;
            Ok(result.and_then(|(_, result)| result).map(|(_, result)| result))
        })
    }

    fn interrupt<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
        hard: bool,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(self.interrupt_execution(workflow, execution_id, hard))
    }

    fn resume<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(self.resume_execution(workflow, execution_id, ResumeMode::Explicit))
    }

    fn await_complete<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // Only an execution active on this runner can be watched; elsewhere the caller
            // polls on its schedule.
            let Some(activation) = self.activation(execution_id) else {
                return std::future::pending().await;
            };
            let mut runs = activation.runs.subscribe();
            drop(activation);
            loop {
                if runs.changed().await.is_err() {
                    return std::future::pending().await;
                }
                // The reply is stored just after the run's handler returns.
                let mut backoff =
                    Backoff::doubling(Duration::from_millis(10), Duration::from_millis(1_280));
                for _ in 0..8 {
                    match self.poll(workflow, execution_id).await {
                        Ok(Some(WorkflowResult::Complete(_))) => return,
                        Ok(Some(WorkflowResult::Suspended { .. })) => break,
                        _ => {}
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        })
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        // The runtime owns the runs (`Sharding::shutdown` hands them off); the queue workers
        // are this engine's.
        Box::pin(self.queues.shutdown())
    }

    fn offer<'a>(
        &'a self,
        queue: &'a str,
        item_id: &'a str,
        token: Token,
        payload: RawJson,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(async move { self.queues.offer(queue, item_id, &token, &payload).await })
    }

    fn register_queue_worker(
        &self,
        queue: &'static str,
        worker: QueueWorker,
    ) -> Result<(), WorkflowError> {
        let me = self.me.clone();
        let stopped =
            Arc::new(move || me.upgrade().is_none_or(|engine| engine.sharding.is_shutdown()));
        let backend: Weak<dyn Backend> = self.me.clone();
        self.queues.register(queue, worker, backend, stopped)
    }
}

#[cfg(test)]
mod tests {
    use cluster_core::{ShardingConfig, SystemClock};
    use cluster_storage_sql::{
        SqlStorageOptions, SqliteMessageStorage, SqliteOptions, TablePrefix,
    };

    use super::*;

    /// One engine per runtime: a second one would register the same entity types, so it is
    /// refused with a typed error, and the first keeps working.
    #[tokio::test]
    async fn a_second_engine_on_one_runtime_is_refused() {
        let config = ShardingConfig::default();
        let path = std::env::temp_dir().join(format!("workflow-second-{}.db", std::process::id()));
        let options =
            SqliteOptions::new(SqlStorageOptions::from_config(&config, TablePrefix::default()));
        let storage = Arc::new(SqliteMessageStorage::open(&path, options).await.unwrap());
        let sharding = Sharding::builder(config).messages(storage).start().await.unwrap();
        let first = WorkflowEngine::cluster(&sharding).unwrap();
        let second = WorkflowEngine::cluster(&sharding).unwrap_err();
        assert!(
            matches!(&second, WorkflowError::Invalid(message) if message.contains("already has")),
            "{second:?}"
        );
        drop(first);
        sharding.shutdown().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
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
        let sharding = Sharding::builder(config)
            .clock(clock)
            .messages(storage)
            .client_only()
            .start()
            .await
            .unwrap();
        let cluster = ClusterEngine::attach(&sharding, ClusterOptions::default()).unwrap();
        let engine = WorkflowEngine { backend: Arc::clone(&cluster) as Arc<dyn Backend> };
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
