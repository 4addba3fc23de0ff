//! The engine contract ([`Backend`], implemented by the in-memory and the cluster engine) and
//! the typed handle applications use ([`WorkflowEngine`]): execute, poll, interrupt, resume,
//! complete deferreds (bodies are registered with [`Workflow::register`]).
//!
//! The engines differ in where durable facts live and how a run is woken; what a run does with
//! its body — drive it, decide its result, close its scopes — is shared here
//! ([`ending`] for the engines' interrupt decisions, then [`finish_run`]), so both engines follow
//! `effect/src/workflow/Workflow.ts` the same way.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::DecodeError;
use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson};
use cluster_core::future::BoxFuture;
use cluster_sharding::RegisterError;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::context::WorkflowContext;
use crate::definition::WorkflowOptions;
use crate::id::{ExecutionId, Token};
use crate::result::{WorkflowResult, filter_interrupts, interrupt_reason, squash};
use crate::run::{BodyEnd, ChildLink, Finalizer, Run, RunExit};

/// Why the engine could not do what was asked.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum WorkflowError {
    /// No body is registered for the workflow on this engine.
    #[error("workflow {0} is not registered")]
    NotRegistered(String),
    /// The execution ended without a result (a defect with `capture_defects` off); its cause.
    #[error("the execution ended without a result: {0:?}")]
    NoResult(Cause),
    /// The engine is shut down.
    #[error("the workflow engine is shut down")]
    ShutDown,
    /// Storage or the cluster failed; the operation may be retried.
    #[error("the cluster failed: {what}")]
    Cluster {
        /// What failed.
        what: String,
        /// The typed error underneath, when there is one.
        #[source]
        source: Option<ClusterFailure>,
    },
    /// A value could not be encoded or decoded.
    #[error("malformed value: {0}")]
    Malformed(#[source] DecodeError),
    /// Used wrongly (for example `detached` without `discard`).
    #[error("{0}")]
    Invalid(String),
    /// A deferred the engine keeps for its own records cannot be completed from outside.
    #[error(transparent)]
    ReservedName(#[from] crate::name::ReservedName),
    /// The execution was never started: a deferred of it cannot be completed.
    #[error(
        "workflow {workflow} has no execution {execution_id}: start it before completing its deferreds"
    )]
    NoSuchExecution {
        /// The workflow's name.
        workflow: String,
        /// The execution id the token names.
        execution_id: ExecutionId,
    },
    /// The runtime refused to register an entity type the engine runs on.
    #[error("could not register {entity_type}")]
    Register {
        /// The entity type (`Workflow/<name>`, `Workflow/-/DurableClock`).
        entity_type: String,
        /// Why.
        #[source]
        source: Arc<RegisterError>,
    },
}

/// The typed error under a [`WorkflowError::Cluster`].
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClusterFailure {
    /// The runtime refused or lost a call.
    #[error(transparent)]
    Cluster(#[from] cluster_core::ClusterError),
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] cluster_core::StorageError),
}

impl WorkflowError {
    /// A cluster failure described in words, without a typed error underneath.
    pub(crate) fn cluster(what: impl Into<String>) -> WorkflowError {
        WorkflowError::Cluster { what: what.into(), source: None }
    }

    /// A cluster failure with its typed error underneath.
    pub(crate) fn cluster_from(what: &str, source: impl Into<ClusterFailure>) -> WorkflowError {
        WorkflowError::Cluster { what: what.to_owned(), source: Some(source.into()) }
    }

    /// Whether doing the same again fails the same way: a value that cannot be encoded, or
    /// that storage refuses (`InvalidInput`, such as a value over its size limit). A run that
    /// meets one ends with a defect instead of being replayed without end.
    pub(crate) fn is_permanent(&self) -> bool {
        use cluster_core::ClusterError;
        use cluster_core::error::StorageErrorKind;
        let refused = |error: &cluster_core::StorageError| {
            matches!(error.kind(), StorageErrorKind::InvalidInput)
        };
        match self {
            WorkflowError::Malformed(_) | WorkflowError::Invalid(_) => true,
            WorkflowError::Cluster { source: Some(ClusterFailure::Storage(error)), .. } => {
                refused(error)
            }
            WorkflowError::Cluster { source: Some(ClusterFailure::Cluster(error)), .. } => {
                match error {
                    ClusterError::Persistence(error) => refused(error),
                    ClusterError::MalformedMessage(_) => true,
                    _ => false,
                }
            }
            _ => false,
        }
    }
}

/// Why `execute` did not return the workflow's success value.
#[derive(Debug, thiserror::Error)]
pub enum ExecuteError<E> {
    /// The workflow failed with its own error.
    #[error("the workflow failed")]
    Failed(E),
    /// The workflow died: a panic, a value that could not be decoded; the defect's JSON.
    #[error("the workflow died: {0}")]
    Defect(String),
    /// The workflow was interrupted.
    #[error("the workflow was interrupted")]
    Interrupted,
    /// The caller's `suspended_retry` schedule ended while the execution was suspended.
    #[error("{0}.execute: suspendedRetrySchedule exhausted")]
    RetriesExhausted(&'static str),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] WorkflowError),
}

/// What runs an activity's body for an engine: given the activity's own run and, for an
/// activity run in a storage transaction, that transaction, it returns the activity's result.
pub(crate) type ActivityBody<'a> = Box<
    dyn FnOnce(Arc<Run>, Option<cluster_sharding::TransactionSlot>) -> BoxFuture<'a, WorkflowResult>
        + Send
        + 'a,
>;

/// One attempt of an activity, as the body asks an engine for it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActivityStep<'a> {
    /// The activity's name.
    pub(crate) name: &'a str,
    /// The attempt (1, 2, …).
    pub(crate) attempt: u32,
    /// Whether its body runs in the storage transaction its result is saved in.
    pub(crate) transactional: bool,
}

/// A body type-erased for an engine: decodes the payload, runs, encodes the outcome.
pub(crate) type ErasedBody =
    Arc<dyn Fn(WorkflowContext, RawJson) -> BoxFuture<'static, Exit> + Send + Sync>;

/// A registered workflow.
#[derive(Clone)]
pub(crate) struct Registration {
    pub(crate) name: &'static str,
    pub(crate) options: WorkflowOptions,
    pub(crate) body: ErasedBody,
}

/// The parent of a child execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Parent {
    pub(crate) workflow: &'static str,
    pub(crate) execution_id: ExecutionId,
    pub(crate) detached: bool,
}

/// How a resume wakes a suspended execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ResumeMode {
    /// A deferred, clock or child completion: never resets a `failed` suspension.
    Automatic,
    /// An operator's resume or an interrupt.
    Explicit,
}

/// What an engine provides. Methods taking a run are called from inside that run.
pub(crate) trait Backend: Send + Sync + 'static {
    /// Registers a body.
    fn register(&self, registration: Registration) -> Result<(), WorkflowError>;

    /// The stored result of the activity `step` names in the run's execution, or the result
    /// of running it now with `execute` (which drives the activity body under the activity's
    /// own run, in the storage transaction of its result when the step asks for one and the
    /// engine has one).
    fn activity<'a>(
        &'a self,
        run: &'a Arc<Run>,
        step: ActivityStep<'a>,
        execute: ActivityBody<'a>,
    ) -> BoxFuture<'a, Result<WorkflowResult, WorkflowError>>;

    /// The completion of deferred `name` of the run's execution, if any.
    fn deferred_result<'a>(
        &'a self,
        run: &'a Arc<Run>,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Exit>, WorkflowError>>;

    /// Completes the deferred a token names (the first completion wins) and wakes its
    /// execution. `from` is the calling run, when a run completes a deferred.
    fn deferred_done<'a>(
        &'a self,
        from: Option<&'a Arc<Run>>,
        token: Token,
        exit: Exit,
    ) -> BoxFuture<'a, Result<(), WorkflowError>>;

    /// Arranges for `DurableClock/<clock>` of the run's execution to complete after `duration`.
    fn schedule_clock<'a>(
        &'a self,
        run: &'a Arc<Run>,
        clock: &'a str,
        duration: Duration,
    ) -> BoxFuture<'a, Result<(), WorkflowError>>;

    /// Runs or attaches to an execution. With `discard`, returns `None` once it is started;
    /// otherwise the result of its current run.
    fn execute<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
        payload: RawJson,
        parent: Option<Parent>,
        discard: bool,
    ) -> BoxFuture<'a, Result<Option<WorkflowResult>, WorkflowError>>;

    /// Whether the execution was started (its run is stored, whatever its state).
    fn execution_exists<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<bool, WorkflowError>>;

    /// The latest result of an execution; `None` while nothing is stored.
    fn poll<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<Option<WorkflowResult>, WorkflowError>>;

    /// Interrupts an execution (safe; `hard` also cuts off an active run).
    fn interrupt<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
        hard: bool,
    ) -> BoxFuture<'a, Result<(), WorkflowError>>;

    /// Wakes a suspended execution explicitly.
    fn resume<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<(), WorkflowError>>;

    /// Resolves once the execution has a result other than `Suspended`; may never resolve.
    fn await_complete<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, ()>;

    /// Makes a workflow's definition known (for routing by shard group), registered here or
    /// not.
    fn define(&self, workflow: &'static str, options: &WorkflowOptions);

    /// Stops the engine: runs in progress are dropped, their callers see an interrupt.
    fn shutdown(&self) -> BoxFuture<'_, ()>;

    /// Offers an item to a durable queue, once per `item_id`.
    fn offer<'a>(
        &'a self,
        queue: &'a str,
        item_id: &'a str,
        token: Token,
        payload: RawJson,
    ) -> BoxFuture<'a, Result<(), WorkflowError>>;

    /// Runs a queue's items here with `worker`.
    fn register_queue_worker(
        &self,
        queue: &'static str,
        worker: QueueWorker,
    ) -> Result<(), WorkflowError>;
}

/// A workflow definition. The body is registered separately, on each engine that runs it
/// ([`Workflow::register`]), so that it can capture the services it needs.
///
/// ```
/// use cluster_workflow::{Workflow, WorkflowEngine};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Clone, Serialize, Deserialize)]
/// struct Order { id: String, amount: u64 }
///
/// struct Checkout;
///
/// impl Workflow for Checkout {
///     const NAME: &'static str = "Checkout";
///     type Payload = Order;
///     type Success = String;
///     type Error = String;
///     fn idempotency_key(order: &Order) -> String { order.id.clone() }
/// }
///
/// let engine = WorkflowEngine::memory();
/// Checkout::register(&engine, |_ctx, order| async move {
///     Ok(format!("charged {}", order.amount))
/// })
/// .unwrap();
/// ```
pub trait Workflow: Send + Sync + 'static {
    /// The workflow's name (the reference's tag): part of every execution id and of the
    /// cluster entity type `Workflow/<NAME>`.
    const NAME: &'static str;
    /// The input of an execution. For the cluster engine it encodes as a JSON object.
    type Payload: Serialize + DeserializeOwned + Send + Sync + 'static;
    /// What a successful execution returns.
    type Success: Serialize + DeserializeOwned + Send + 'static;
    /// The execution's own error.
    type Error: Serialize + DeserializeOwned + Send + 'static;

    /// The idempotency key of a payload: executing a payload with the same key again attaches
    /// to the same execution.
    fn idempotency_key(payload: &Self::Payload) -> String;

    /// How executions of this workflow behave.
    fn options() -> WorkflowOptions {
        WorkflowOptions::default()
    }

    /// The execution id of a payload.
    fn execution_id(payload: &Self::Payload) -> ExecutionId {
        ExecutionId::derive(Self::NAME, &Self::idempotency_key(payload))
    }

    /// Registers this workflow's body on `engine`: `body(context, payload)` runs for every run
    /// of every execution on this engine (a replay runs it again from the top with the stored
    /// results of completed steps). Not meant to be overridden.
    ///
    /// # Errors
    ///
    /// [`WorkflowError::Invalid`] when the workflow is already registered on `engine`.
    fn register<F, Fut>(engine: &WorkflowEngine, body: F) -> Result<(), WorkflowError>
    where
        Self: Sized,
        F: Fn(WorkflowContext, Self::Payload) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Self::Success, Self::Error>> + Send + 'static,
    {
        engine.register::<Self, F, Fut>(body)
    }
}

/// A worker type-erased for an engine: decodes the item's payload, runs, encodes the result;
/// `Err` says why the payload cannot be decoded.
pub(crate) type ErasedWorker =
    Arc<dyn Fn(RawJson) -> BoxFuture<'static, Result<Exit, String>> + Send + Sync>;

/// A worker and how many items it runs at once on this engine.
#[derive(Clone)]
pub(crate) struct QueueWorker {
    pub(crate) run: ErasedWorker,
    pub(crate) concurrency: std::num::NonZeroU32,
}

/// A workflow engine. The in-memory one is [`WorkflowEngine::memory`]; the durable cluster
/// engine on `cluster-sharding` implements the same contract. Cheap to clone.
#[derive(Clone)]
pub struct WorkflowEngine {
    pub(crate) backend: Arc<dyn Backend>,
    /// The cluster runtime the engine runs on, kept alive while this handle lives (the engine
    /// itself holds it weakly); `None` in memory and inside a run.
    pub(crate) _runtime: Option<cluster_sharding::Sharding>,
}

impl std::fmt::Debug for WorkflowEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkflowEngine").finish_non_exhaustive()
    }
}

impl WorkflowEngine {
    /// Registers the body of workflow `W` ([`Workflow::register`]).
    pub(crate) fn register<W, F, Fut>(&self, handler: F) -> Result<(), WorkflowError>
    where
        W: Workflow,
        F: Fn(WorkflowContext, W::Payload) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<W::Success, W::Error>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let body: ErasedBody = Arc::new(move |context, payload| {
            let handler = Arc::clone(&handler);
            Box::pin(async move {
                let payload: W::Payload = match payload.decode() {
                    Ok(payload) => payload,
                    Err(error) => {
                        return Exit::die_with_message("MalformedPayload", &error.to_string());
                    }
                };
                encode_result(handler(context, payload).await)
            })
        });
        self.backend.register(Registration { name: W::NAME, options: W::options(), body })
    }

    /// Executes `payload` (or attaches to the execution with the same idempotency key) and
    /// waits for its result, polling a suspended execution on `W::options().suspended_retry`
    /// (and woken early when the engine can tell).
    ///
    /// # Errors
    ///
    /// The workflow's own failure, a defect, an interrupt, an exhausted retry schedule, or an
    /// engine failure.
    pub async fn execute<W: Workflow>(
        &self,
        payload: W::Payload,
    ) -> Result<W::Success, ExecuteError<W::Error>> {
        let execution_id = W::execution_id(&payload);
        let payload = encode_payload(&payload)?;
        let options = W::options();
        self.backend.define(W::NAME, &options);
        let schedule = options.suspended_retry;
        let span = tracing::debug_span!("workflow.execute", workflow = W::NAME, %execution_id);
        let waiting = async {
            let mut step = 0;
            loop {
                let result = self
                    .backend
                    .execute(W::NAME, &execution_id, payload.clone(), None, false)
                    .await?;
                if let Some(WorkflowResult::Complete(exit)) = result {
                    return decode_outcome::<W::Success, W::Error>(exit);
                }
                let Some(delay) = schedule.delay(step) else {
                    return Err(ExecuteError::RetriesExhausted(W::NAME));
                };
                step += 1;
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = self.backend.await_complete(W::NAME, &execution_id) => {}
                }
            }
        };
        tracing::Instrument::instrument(waiting, span).await
    }

    /// Starts `payload` (or finds its execution) without waiting: returns the execution id once
    /// the run is dispatched.
    ///
    /// # Errors
    ///
    /// An engine failure or an unregistered workflow.
    pub async fn execute_discard<W: Workflow>(
        &self,
        payload: W::Payload,
    ) -> Result<ExecutionId, WorkflowError> {
        let execution_id = W::execution_id(&payload);
        let payload = encode_payload(&payload)?;
        self.backend.define(W::NAME, &W::options());
        self.backend.execute(W::NAME, &execution_id, payload, None, true).await?;
        Ok(execution_id)
    }

    /// The latest result of an execution of `W`: `None` while nothing is stored (and, in the
    /// cluster, while a replay runs).
    ///
    /// # Errors
    ///
    /// An engine failure; [`WorkflowError::NoResult`] for an execution that ended without one.
    pub async fn poll<W: Workflow>(
        &self,
        execution_id: &ExecutionId,
    ) -> Result<Option<WorkflowResult>, WorkflowError> {
        self.backend.define(W::NAME, &W::options());
        self.backend.poll(W::NAME, execution_id).await
    }

    /// Interrupts an execution of `W` durably: it ends with an interrupt at its next activity
    /// or suspension point (a run that finishes without one completes normally). Unknown and
    /// completed executions are left alone.
    ///
    /// # Errors
    ///
    /// An engine failure.
    pub async fn interrupt<W: Workflow>(
        &self,
        execution_id: &ExecutionId,
    ) -> Result<(), WorkflowError> {
        self.backend.define(W::NAME, &W::options());
        self.backend.interrupt(W::NAME, execution_id, false).await
    }

    /// Interrupts an execution of `W` and also cuts off a run in progress.
    ///
    /// # Errors
    ///
    /// An engine failure.
    pub async fn interrupt_unsafe<W: Workflow>(
        &self,
        execution_id: &ExecutionId,
    ) -> Result<(), WorkflowError> {
        self.backend.define(W::NAME, &W::options());
        self.backend.interrupt(W::NAME, execution_id, true).await
    }

    /// Wakes a suspended execution of `W` explicitly, including one suspended by
    /// `suspend_on_failure`.
    ///
    /// # Errors
    ///
    /// An engine failure.
    pub async fn resume<W: Workflow>(
        &self,
        execution_id: &ExecutionId,
    ) -> Result<(), WorkflowError> {
        self.backend.define(W::NAME, &W::options());
        self.backend.resume(W::NAME, execution_id).await
    }

    /// Completes the deferred a token names with `result` (the first completion wins), from
    /// any process running an engine.
    ///
    /// # Errors
    ///
    /// An engine failure, or a value that cannot be encoded.
    pub async fn complete<T: Serialize, E: Serialize>(
        &self,
        token: &Token,
        result: Result<T, E>,
    ) -> Result<(), WorkflowError> {
        let exit = encode_result(result);
        self.complete_exit(token, exit).await
    }

    /// Completes the deferred a token names with an encoded exit.
    ///
    /// Only a deferred of an execution that exists can be completed: a token computed ahead
    /// of the execution (its id is public, see [`TokenKey`](crate::TokenKey)) must not decide
    /// a later execution's step. The engine's own records (the interrupt signal, races, sleeps,
    /// queue items) cannot be completed through a token.
    ///
    /// # Errors
    ///
    /// [`WorkflowError::ReservedName`] for a deferred the engine keeps for itself,
    /// [`WorkflowError::NoSuchExecution`] for an execution that was never started, or an engine
    /// failure.
    pub async fn complete_exit(&self, token: &Token, exit: Exit) -> Result<(), WorkflowError> {
        crate::name::check_deferred(&token.deferred)?;
        if !self.backend.execution_exists(&token.workflow, &token.execution_id).await? {
            return Err(WorkflowError::NoSuchExecution {
                workflow: token.workflow.clone(),
                execution_id: token.execution_id.clone(),
            });
        }
        self.backend.deferred_done(None, token.clone(), exit).await
    }
}

impl WorkflowEngine {
    /// Stops the in-memory engine: runs in progress are dropped and their waiting callers see
    /// an interrupt; nothing starts afterwards. On the cluster engine the runs belong to the
    /// runtime, which hands them to other runners in `Sharding::shutdown`; this stops the
    /// engine's durable queue workers, whose items in flight are interrupted and released to
    /// other workers.
    pub async fn shutdown(&self) {
        self.backend.shutdown().await;
    }
}

fn encode_payload<P: Serialize>(payload: &P) -> Result<RawJson, WorkflowError> {
    RawJson::encode(payload).map_err(WorkflowError::Malformed)
}

/// The exit of a typed result.
pub(crate) fn encode_result<T: Serialize, E: Serialize>(result: Result<T, E>) -> Exit {
    let encoded = match result {
        Ok(value) => RawJson::encode(&value).map(Exit::Success),
        Err(error) => RawJson::encode(&error).map(Exit::fail),
    };
    encoded.unwrap_or_else(|error| Exit::die_with_message("MalformedValue", &error.to_string()))
}

/// A typed exit as a step sees it: a value, the step's own error, or a cause the run re-raises
/// (a defect or an interrupt).
pub(crate) enum Decoded<T, E> {
    Ok(T),
    Fail(E),
    Raise(Cause),
}

/// Decodes an exit (an undefined success reads as `null`).
pub(crate) fn decode_exit<T: DeserializeOwned, E: DeserializeOwned>(exit: Exit) -> Decoded<T, E> {
    match exit {
        Exit::Success(value) => {
            let value = if value.is_undefined() { RawJson::null() } else { value };
            match value.decode() {
                Ok(value) => Decoded::Ok(value),
                Err(error) => Decoded::Raise(malformed(&error.to_string())),
            }
        }
        Exit::Failure(cause) => {
            let error = cause.0.iter().find_map(|reason| match reason {
                CauseReason::Fail(error) => Some(error.clone()),
                _ => None,
            });
            match error {
                Some(error) => match error.decode() {
                    Ok(error) => Decoded::Fail(error),
                    Err(decode) => Decoded::Raise(malformed(&decode.to_string())),
                },
                None => Decoded::Raise(cause),
            }
        }
    }
}

fn malformed(message: &str) -> Cause {
    match Exit::die_with_message("MalformedValue", message) {
        Exit::Failure(cause) => cause,
        Exit::Success(_) => Cause(Vec::new()),
    }
}

/// What an external caller gets from a final exit.
pub(crate) fn decode_outcome<T: DeserializeOwned, E: DeserializeOwned>(
    exit: Exit,
) -> Result<T, ExecuteError<E>> {
    match decode_exit(exit) {
        Decoded::Ok(value) => Ok(value),
        Decoded::Fail(error) => Err(ExecuteError::Failed(error)),
        Decoded::Raise(cause) => Err(cause_error(&cause)),
    }
}

fn cause_error<E>(cause: &Cause) -> ExecuteError<E> {
    let defect = cause.0.iter().find_map(|reason| match reason {
        CauseReason::Die(defect) => Some(defect.json_or_null().to_owned()),
        _ => None,
    });
    match defect {
        Some(defect) => ExecuteError::Defect(defect),
        None => ExecuteError::Interrupted,
    }
}

/// How a run ended, after the engine's interrupt decision.
#[derive(Debug)]
pub(crate) enum RunOutcome {
    /// A result to store.
    Result(WorkflowResult),
    /// No result: the run was cut off from outside, abandoned, broken by an engine failure, or
    /// died with `capture_defects` off.
    NoResult(Cause),
}

/// The run's result from how its body ended (the reference's `intoResult`,
/// `effect/src/cluster/ClusterWorkflowEngine.ts`).
fn into_result(run: &Run, end: &BodyEnd) -> RunOutcome {
    let mut state = run.state();
    let interrupt_only = Cause(vec![interrupt_reason()]);
    if state.broken.is_some() {
        return RunOutcome::NoResult(interrupt_only);
    }
    let body_exit = match end {
        BodyEnd::Returned(exit) => Some(exit.clone()),
        BodyEnd::Stopped => state.raised.clone().map(Exit::Failure),
    };
    if state.interrupted {
        let cause = match body_exit {
            Some(Exit::Failure(Cause(mut reasons))) => {
                reasons.push(interrupt_reason());
                filter_interrupts(Cause(reasons))
            }
            _ => interrupt_only,
        };
        return RunOutcome::Result(WorkflowResult::Complete(Exit::Failure(cause)));
    }
    match body_exit {
        None => {
            if state.abandoned {
                RunOutcome::NoResult(interrupt_only)
            } else {
                RunOutcome::Result(WorkflowResult::Suspended {
                    cause: state.cause.clone(),
                    failed: state.failed,
                })
            }
        }
        Some(Exit::Success(value)) => {
            RunOutcome::Result(WorkflowResult::Complete(Exit::Success(value)))
        }
        Some(Exit::Failure(cause)) => {
            if state.abandoned {
                return RunOutcome::NoResult(cause);
            }
            if run.options.suspend_on_failure && !cause.has_interrupts_only() {
                state.failed = true;
                state.suspended = true;
                let cause = Cause(vec![CauseReason::Die(squash(&cause))]);
                return RunOutcome::Result(WorkflowResult::Suspended {
                    cause: Some(cause),
                    failed: true,
                });
            }
            let has_defect = cause.0.iter().any(|reason| matches!(reason, CauseReason::Die(_)));
            if !run.options.capture_defects && has_defect {
                return RunOutcome::NoResult(cause);
            }
            RunOutcome::Result(WorkflowResult::Complete(Exit::Failure(filter_interrupts(cause))))
        }
    }
}

/// Closes one run's workflow scope: its finalizers (compensations among them) in reverse
/// registration order, unless the run was abandoned.
async fn close_scope(finalizers: Vec<Finalizer>, exit: RunExit, abandoned: bool) {
    if abandoned {
        return;
    }
    for finalizer in finalizers.into_iter().rev() {
        // The closure is called inside the guard too: a finalizer may panic before it returns
        // its future, and that panic must not unwind through the run's handler.
        let exit = exit.clone();
        let outcome = cluster_core::future::guarded(move || finalizer(exit)).await;
        if outcome.is_err() {
            tracing::warn!("a workflow finalizer panicked");
        }
    }
}

/// A run's workflow scope: its finalizers, and whether the run was abandoned.
pub(crate) type Scope = (Vec<Finalizer>, bool);

/// How a body ended, as the engines' interrupt decisions read it.
pub(crate) struct Ending {
    /// It was stopped at a suspension (not by a raised failure or an engine failure).
    pub(crate) suspended: bool,
    /// It failed (not only by interrupts) in a `suspend_on_failure` workflow.
    pub(crate) failed_under_sof: bool,
}

/// How `run`'s body ended.
pub(crate) fn ending(run: &Run, end: &BodyEnd) -> Ending {
    let state = run.state();
    let suspended = matches!(end, BodyEnd::Stopped)
        && state.suspended
        && state.raised.is_none()
        && state.broken.is_none();
    let failed_under_sof = run.options.suspend_on_failure
        && match end {
            BodyEnd::Returned(Exit::Failure(cause)) => !cause.has_interrupts_only(),
            BodyEnd::Returned(Exit::Success(_)) => false,
            BodyEnd::Stopped => {
                state.raised.as_ref().is_some_and(|cause| !cause.has_interrupts_only())
            }
        };
    Ending { suspended, failed_under_sof }
}

/// Finishes a run after the engine's interrupt decision: its outcome and the children to
/// interrupt ([`run_outcome`]), then its scopes closed ([`close_run`]).
pub(crate) async fn finish_run(
    run: &Run,
    end: &BodyEnd,
    retain: impl FnOnce(Option<Scope>) -> Vec<Scope>,
) -> (RunOutcome, Vec<ChildLink>) {
    let (outcome, children) = run_outcome(run, end);
    close_run(run, &outcome, retain).await;
    (outcome, children)
}

/// How a run ended, for its metric.
fn run_end(outcome: &RunOutcome) -> crate::metrics::RunEnd {
    use crate::metrics::RunEnd;
    match outcome {
        RunOutcome::Result(WorkflowResult::Complete(Exit::Success(_))) => RunEnd::Completed,
        RunOutcome::Result(WorkflowResult::Complete(Exit::Failure(_))) => RunEnd::Failed,
        RunOutcome::Result(WorkflowResult::Suspended { .. }) => RunEnd::Suspended,
        RunOutcome::NoResult(_) => RunEnd::Stopped,
    }
}

/// A finished run's result ([`into_result`]) and the children an applied interrupt must
/// interrupt too (the interrupt link).
pub(crate) fn run_outcome(run: &Run, end: &BodyEnd) -> (RunOutcome, Vec<ChildLink>) {
    let outcome = into_result(run, end);
    crate::metrics::run_ended(run.workflow, run_end(&outcome));
    let state = run.state();
    let children = if state.interrupted {
        state.children.iter().filter(|child| !child.complete).cloned().collect()
    } else {
        Vec::new()
    };
    (outcome, children)
}

/// Closes a finished run's scopes: its own with the outcome's exit (or, for a suspension,
/// handed to `retain` to keep), and, when the execution ended, the retained scopes of the runs
/// it superseded (which `retain` hands back) with success, newest first. A run with no result
/// leaves the retained scopes alone (`retain` is not called).
pub(crate) async fn close_run(
    run: &Run,
    outcome: &RunOutcome,
    retain: impl FnOnce(Option<Scope>) -> Vec<Scope>,
) {
    let own_scope = close_run_scope(run, outcome).await;
    // A run with no result did not end the execution: the scopes it superseded stay.
    if !matches!(outcome, RunOutcome::NoResult(_)) {
        close_retained(retain(own_scope), false).await;
    }
}

/// What an execution's `retain` does with a finished run's scope: keeps a suspended run's
/// (`Some`), or hands back every retained scope once the execution ended (`None`).
pub(crate) fn retain_scope(retained: &mut Vec<Scope>, own: Option<Scope>) -> Vec<Scope> {
    match own {
        Some(scope) => {
            retained.push(scope);
            Vec::new()
        }
        None => std::mem::take(retained),
    }
}

/// Closes the run's own workflow scope with the outcome's exit, unless the run suspended: a
/// suspended run's scope is returned for the engine to retain until the execution ends. A run
/// the engine broke off (a storage failure under it) is skipped like an abandoned one: the
/// execution did not fail, and its replay registers the compensations again.
async fn close_run_scope(run: &Run, outcome: &RunOutcome) -> Option<Scope> {
    let (finalizers, interrupted, abandoned) = {
        let mut state = run.state();
        let abandoned = state.abandoned || state.broken.is_some();
        (std::mem::take(&mut state.finalizers), state.interrupted, abandoned)
    };
    let exit = match outcome {
        RunOutcome::Result(WorkflowResult::Suspended { .. }) => {
            return Some((finalizers, abandoned));
        }
        RunOutcome::Result(WorkflowResult::Complete(exit)) => exit.clone(),
        RunOutcome::NoResult(cause) => Exit::Failure(cause.clone()),
    };
    close_scope(finalizers, RunExit { exit, interrupted }, abandoned).await;
    None
}

/// Closes retained scopes of superseded runs with success, newest first; all are skipped when
/// `abandoned`.
async fn close_retained(retained: Vec<Scope>, abandoned: bool) {
    for (finalizers, run_abandoned) in retained.into_iter().rev() {
        let exit = RunExit { exit: Exit::void(), interrupted: false };
        close_scope(finalizers, exit, abandoned || run_abandoned).await;
    }
}

#[cfg(test)]
mod tests {
    use cluster_core::error::{StorageError, StorageErrorKind};

    use super::*;

    #[test]
    fn a_cluster_failure_keeps_its_typed_source() {
        let storage = StorageError::new(StorageErrorKind::Unavailable, "connection refused");
        let error = WorkflowError::cluster_from("a storage operation failed", storage);
        assert_eq!(error.to_string(), "the cluster failed: a storage operation failed");
        let source = std::error::Error::source(&error).map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("connection refused (unavailable)"));
        let WorkflowError::Cluster { source: Some(ClusterFailure::Storage(kept)), .. } = error
        else {
            panic!("the storage error is not kept: {error:?}");
        };
        assert_eq!(kept.kind(), StorageErrorKind::Unavailable);
        let words = WorkflowError::cluster("failed to reset an activity");
        assert!(std::error::Error::source(&words).is_none());
    }
}
