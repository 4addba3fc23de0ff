//! What a workflow body works with: [`WorkflowContext`] — activities, durable deferreds,
//! durable sleep, races, child workflows, workflow finalizers and compensation.
//!
//! Every step is memoized by the engine: a replay runs the body again from the top and each
//! completed step returns its stored result without running again. A step that cannot go on
//! (a deferred with no completion, a suspended activity or child) never returns: the run
//! suspends once nothing else is in flight, and the body's future is dropped. Code outside
//! activities must therefore be deterministic: the same steps, with the same names, in the
//! same order on every replay.

use std::future::{Future, IntoFuture};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::transaction::{BackendLock, TransactionError, TransactionSource};
use cluster_sharding::TransactionSlot;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::engine::Workflow;
use crate::engine::{
    ActivityBody, ActivityStep, Decoded, Parent, WorkflowEngine, decode_exit, encode_result,
};
use crate::id::{ExecutionId, Token};
use crate::name::ReservedName;
use crate::result::{FailureCause, WorkflowResult};
use crate::run::{
    BodyEnd, Branch, Run, RunExit, RunKind, RunOptions, drive, in_branch, note_branch_await,
};

pub use cluster_core::Never;

/// The default threshold of [`WorkflowContext::sleep`]: up to one minute a sleep is an
/// activity, above it a durable wake.
pub const DEFAULT_IN_MEMORY_SLEEP_THRESHOLD: Duration = Duration::from_secs(60);

/// A durable deferred: a named completion of an execution, which the body awaits and anyone
/// holding its [`Token`] completes (the first completion wins).
#[derive(Debug)]
pub struct DurableDeferred<T, E = Never> {
    name: String,
    types: PhantomData<fn() -> (T, E)>,
}

impl<T, E> Clone for DurableDeferred<T, E> {
    fn clone(&self) -> Self {
        DurableDeferred { name: self.name.clone(), types: PhantomData }
    }
}

impl<T, E> DurableDeferred<T, E> {
    /// The deferred `name` (unique within an execution).
    ///
    /// # Errors
    ///
    /// [`ReservedName`] when `name` starts with a prefix the engine keeps for its own records
    /// (`raceAll/`, `DurableClock/`, `DurableQueue/`, `Workflow/`).
    pub fn new(name: impl Into<String>) -> Result<DurableDeferred<T, E>, ReservedName> {
        let name = name.into();
        crate::name::check_deferred(&name)?;
        Ok(DurableDeferred { name, types: PhantomData })
    }

    /// A deferred of the engine's own, under a reserved name.
    pub(crate) fn reserved(name: String) -> DurableDeferred<T, E> {
        DurableDeferred { name, types: PhantomData }
    }

    /// The deferred's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The deferred of this name for the current attempt of an activity (`<name>/<attempt>`).
    pub fn with_attempt(&self, attempt: u32) -> DurableDeferred<T, E> {
        // A checked name with a suffix keeps its (allowed) prefix.
        DurableDeferred { name: format!("{}/{attempt}", self.name), types: PhantomData }
    }

    /// The token of this deferred in the execution `execution_id` of workflow `W`.
    pub fn token_for<W: Workflow>(&self, execution_id: &ExecutionId) -> Token {
        Token {
            workflow: W::NAME.to_owned(),
            execution_id: execution_id.clone(),
            deferred: self.name.clone(),
        }
    }

    /// The token of this deferred in the execution of `W` for `payload`.
    pub fn token_for_payload<W: Workflow>(&self, payload: &W::Payload) -> Token {
        self.token_for::<W>(&W::execution_id(payload))
    }
}

/// The handle a workflow body (and an activity body, through [`ActivityContext`]) works with.
/// Cheap to clone; clones belong to the same run.
#[derive(Clone, Debug)]
pub struct WorkflowContext {
    pub(crate) run: Arc<Run>,
}

/// What an activity body gets: its attempt, the storage transaction of a transactional
/// activity (as a [`TransactionSource`]), and the steps an activity may take itself (a durable
/// sleep or deferred inside an activity suspends the activity, which runs again from its start
/// on the next replay).
#[derive(Clone)]
pub struct ActivityContext {
    context: WorkflowContext,
    transaction: Option<TransactionSlot>,
}

impl std::fmt::Debug for ActivityContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivityContext")
            .field("context", &self.context)
            .field("transaction", &self.transaction.is_some())
            .finish()
    }
}

/// The storage transaction in which this activity's result is saved, for an activity called
/// with [`ActivityCall::with_transaction`] on the cluster engine. The typed guard of the
/// storage's backend locks it, for example `PgTransactionGuard::of(&activity)` of
/// `cluster-storage-sql` (see `docs/workflows.md`). The body's own statements commit together
/// with the activity's success, or not at all. Other activities, and every activity on the
/// in-memory engine, have none ([`TransactionError::Missing`]).
impl TransactionSource for ActivityContext {
    fn lock_backend(&self) -> BoxFuture<'_, Result<BackendLock<'_>, TransactionError>> {
        cluster_sharding::lock_backend(self.transaction.as_ref())
    }
}

impl ActivityContext {
    /// The attempt being run: 1, then 2, 3, … under [`ActivityCall::retry`].
    pub fn attempt(&self) -> u32 {
        match self.context.run.kind {
            RunKind::Activity(attempt) => attempt,
            RunKind::Body => 1,
        }
    }

    /// The execution the activity belongs to.
    pub fn execution_id(&self) -> &ExecutionId {
        self.context.execution_id()
    }

    /// The activity's own workflow context (deferreds and sleeps suspend the activity).
    pub fn context(&self) -> &WorkflowContext {
        &self.context
    }

    /// Ends this run of the activity body with an interrupt, for example after a call it made
    /// was interrupted because the callee's shard moved ([`CallError::Interrupted`]). The
    /// activity's interrupt retry policy ([`ActivityCall::interrupt_retry`]) runs the body again;
    /// once it is exhausted the activity dies.
    ///
    /// [`CallError::Interrupted`]: cluster_sharding::CallError::Interrupted
    pub async fn interrupt<T>(&self) -> T {
        self.context.run.raise(Cause(vec![CauseReason::Interrupt { fiber_id: None }])).await;
        unreachable_step()
    }
}

/// How an activity body cut off by an interrupt is run again (the reference's
/// `interruptRetryPolicy` of `effect/src/workflow/Activity.ts`, `retryOnInterrupt`): a body
/// whose run ends with a cause that contains an interrupt (an interrupt re-raised from a step
/// it awaited, [`ActivityContext::interrupt`], or an engine failure under it) runs again after
/// a delay, unless it suspended on purpose. A body that fails on its own (an `Err`, a panic)
/// is not retried here. When the retries are used up and the cause still holds an interrupt,
/// the activity dies with `Activity "<name>" interrupted and retry attempts exhausted`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InterruptRetry {
    /// How many times the body runs again at most (10).
    pub max_retries: u32,
    /// The delay before the first retry (400 ms).
    pub first_delay: Duration,
    /// The factor each later delay grows by (1.5).
    pub factor: f64,
    /// The longest delay (10 s).
    pub max_delay: Duration,
}

impl Default for InterruptRetry {
    /// The reference's policy: `min(exponential(400 ms, 1.5), spaced(10 s))` while the retry
    /// is at most the tenth.
    fn default() -> InterruptRetry {
        InterruptRetry {
            max_retries: 10,
            first_delay: Duration::from_millis(400),
            factor: 1.5,
            max_delay: Duration::from_secs(10),
        }
    }
}

impl InterruptRetry {
    /// No retry: an interrupted body dies at once.
    pub fn none() -> InterruptRetry {
        InterruptRetry { max_retries: 0, ..InterruptRetry::default() }
    }

    /// The delay before retry `retry` (1, 2, …): `first_delay × factor^(retry − 1)`, at most
    /// `max_delay`.
    pub fn delay(&self, retry: u32) -> Duration {
        let exponent = i32::try_from(retry.saturating_sub(1)).unwrap_or(i32::MAX);
        let millis = self.first_delay.as_secs_f64() * 1000.0 * self.factor.powi(exponent);
        let max = self.max_delay.as_secs_f64() * 1000.0;
        if millis.is_finite() && millis >= 0.0 && millis < max {
            Duration::from_secs_f64(millis / 1000.0)
        } else {
            self.max_delay
        }
    }
}

impl WorkflowContext {
    pub(crate) fn new(run: Arc<Run>) -> WorkflowContext {
        WorkflowContext { run }
    }

    /// The execution's id.
    pub fn execution_id(&self) -> &ExecutionId {
        &self.run.execution_id
    }

    /// The workflow's name.
    pub fn workflow_name(&self) -> &'static str {
        self.run.workflow
    }

    /// The engine running this workflow, to execute or complete other workflows.
    pub fn engine(&self) -> WorkflowEngine {
        WorkflowEngine { backend: Arc::clone(&self.run.engine), _runtime: None }
    }

    /// Whether this run is suspending (readable from a body finalizer: a `Drop` runs when the
    /// body is dropped at a suspension).
    pub fn is_suspended(&self) -> bool {
        self.run.state().suspended
    }

    /// Whether an interrupt is applied to this run (visible to workflow finalizers of the run
    /// that applies it; body finalizers run before it is applied).
    pub fn is_interrupted(&self) -> bool {
        self.run.state().interrupted
    }

    /// The accumulated suspension cause of this run.
    pub fn suspension_cause(&self) -> Option<FailureCause> {
        self.run.state().cause.clone().map(FailureCause)
    }

    /// The token of `deferred` in this execution.
    pub fn token<T, E>(&self, deferred: &DurableDeferred<T, E>) -> Token {
        Token {
            workflow: self.run.workflow.to_owned(),
            execution_id: self.run.execution_id.clone(),
            deferred: deferred.name.clone(),
        }
    }

    /// An activity: `body` runs at most until it completes once per execution, name and
    /// attempt; a replay gets its stored result. Await the returned call, optionally after
    /// [`retry`](ActivityCall::retry), [`compensate`](ActivityCall::compensate) or
    /// [`catch_defects`](ActivityCall::catch_defects).
    ///
    /// A name that starts with a prefix the engine keeps for its own records (`DurableClock/`)
    /// is refused: awaiting the call ends the run with a defect that says so ([`ReservedName`]).
    pub fn activity<A, E, F, Fut>(
        &self,
        name: impl Into<String>,
        body: F,
    ) -> ActivityCall<'_, A, E, F>
    where
        F: Fn(ActivityContext) -> Fut + Send + Sync,
        Fut: Future<Output = Result<A, E>> + Send,
    {
        let name = name.into();
        let refused = crate::name::check_activity(&name).err();
        ActivityCall { refused, ..self.reserved_activity(name, body) }
    }

    /// An activity of the engine's own, under a reserved name.
    fn reserved_activity<A, E, F, Fut>(&self, name: String, body: F) -> ActivityCall<'_, A, E, F>
    where
        F: Fn(ActivityContext) -> Fut + Send + Sync,
        Fut: Future<Output = Result<A, E>> + Send,
    {
        ActivityCall {
            context: self,
            name,
            refused: None,
            body,
            retries: 0,
            transactional: false,
            interrupt_retry: InterruptRetry::default(),
            types: PhantomData,
        }
    }

    /// Runs one attempt of an activity and decodes its exit; suspends the run if it suspended.
    async fn activity_attempt<'b, A, E, F, Fut>(
        &'b self,
        step: ActivityStep<'b>,
        interrupt_retry: InterruptRetry,
        body: &'b F,
    ) -> Decoded<A, E>
    where
        A: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        F: Fn(ActivityContext) -> Fut + Send + Sync,
        Fut: Future<Output = Result<A, E>> + Send,
    {
        let run = &self.run;
        let options = run.options;
        let name = step.name;
        let execute: ActivityBody<'b> = Box::new(move |activity_run: Arc<Run>, transaction| {
            Box::pin(async move {
                let mut retry = 0;
                let first = (step.attempt > 1).then_some(crate::metrics::Retry::Failure);
                crate::metrics::activity_attempt(activity_run.workflow, first);
                loop {
                    // Every run of the body starts from the transaction's state before the
                    // first: a retry must not commit the writes of the run it replaces.
                    if let Err(error) = clean_start(transaction.as_ref(), retry).await {
                        tracing::warn!(activity = name, execution_id = %activity_run.execution_id, %error, "the activity's transaction cannot give its body a clean start");
                        let message = format!(
                            "Activity \"{name}\" could not start from a clean transaction: {error}"
                        );
                        let defect = RawJson::encode(&message).unwrap_or_else(|_| RawJson::null());
                        return activity_result(Exit::die(defect), options);
                    }
                    let context = ActivityContext {
                        context: WorkflowContext::new(Arc::clone(&activity_run)),
                        transaction: transaction.clone(),
                    };
                    let end =
                        drive(&activity_run, async { encode_result(body(context).await) }).await;
                    let Some(exit) = activity_exit(&activity_run, end) else {
                        let state = activity_run.state();
                        return WorkflowResult::Suspended {
                            cause: state.cause.clone(),
                            failed: state.failed,
                        };
                    };
                    let interrupted = matches!(&exit, Exit::Failure(cause) if cause.has_interrupts())
                        && !activity_run.state().suspended;
                    if !interrupted {
                        return activity_result(exit, options);
                    }
                    if retry >= interrupt_retry.max_retries {
                        tracing::warn!(activity = name, execution_id = %activity_run.execution_id, retries = retry, "activity interrupted and retry attempts exhausted");
                        let message =
                            format!("Activity \"{name}\" interrupted and retry attempts exhausted");
                        let defect = RawJson::encode(&message).unwrap_or_else(|_| RawJson::null());
                        return activity_result(Exit::die(defect), options);
                    }
                    retry += 1;
                    let again = Some(crate::metrics::Retry::Interrupt);
                    crate::metrics::activity_attempt(activity_run.workflow, again);
                    let delay = interrupt_retry.delay(retry);
                    tracing::info!(activity = name, execution_id = %activity_run.execution_id, retry, ?delay, "activity interrupted: running it again");
                    activity_run.reset_for_retry();
                    tokio::time::sleep(delay).await;
                }
            })
        });
        let hold = run.hold();
        let result = run.engine.activity(run, step, execute).await;
        hold.release();
        match result {
            Err(error) => {
                run.break_with(&error).await;
                unreachable_step()
            }
            Ok(WorkflowResult::Suspended { cause, failed }) => {
                if failed {
                    run.update(|state| state.failed = true);
                }
                run.suspend(cause).await;
                unreachable_step()
            }
            Ok(WorkflowResult::Complete(exit)) => decode_exit(exit),
        }
    }

    /// Awaits `deferred`: its completion if one is stored (or saved and not yet processed),
    /// otherwise the run suspends until it is completed. A completion that is a defect or an
    /// interrupt ends the run with it.
    pub async fn await_deferred<T, E>(&self, deferred: &DurableDeferred<T, E>) -> Result<T, E>
    where
        T: DeserializeOwned,
        E: DeserializeOwned,
    {
        let exit = self.deferred_exit(&deferred.name).await;
        self.settle(decode_exit(exit)).await
    }

    /// The stored exit of deferred `name`, or a suspension.
    pub(crate) async fn deferred_exit(&self, name: &str) -> Exit {
        let run = &self.run;
        run.register_await(name);
        let hold = run.hold();
        let result = run.engine.deferred_result(run, name).await;
        hold.release();
        match result {
            Ok(Some(exit)) => exit,
            Ok(None) => {
                run.suspend(None).await;
                unreachable_step()
            }
            Err(error) => {
                run.break_with(&error).await;
                unreachable_step()
            }
        }
    }

    /// A typed result, re-raising a defect or interrupt.
    async fn settle<T, E>(&self, decoded: Decoded<T, E>) -> Result<T, E> {
        match decoded {
            Decoded::Ok(value) => Ok(value),
            Decoded::Fail(error) => Err(error),
            Decoded::Raise(cause) => {
                self.run.raise(cause).await;
                unreachable_step()
            }
        }
    }

    /// Completes `deferred` of this execution from inside the run (the first completion wins).
    /// The run does not wake itself for it.
    pub async fn complete<T: Serialize, E: Serialize>(
        &self,
        deferred: &DurableDeferred<T, E>,
        result: Result<T, E>,
    ) {
        let token = self.token(deferred);
        self.run.update(|state| state.completed.insert(deferred.name.clone()));
        if let Err(error) =
            self.run.engine.deferred_done(Some(&self.run), token, encode_result(result)).await
        {
            self.run.break_with(&error).await;
        }
    }

    /// Sleeps durably for `duration` under the clock `name` (unique within the execution):
    /// zero returns at once; up to [`DEFAULT_IN_MEMORY_SLEEP_THRESHOLD`] it is an activity
    /// (restarted in full if the run is replayed before it ends); above, a durable wake that
    /// survives restarts while the run is suspended.
    pub async fn sleep(&self, name: &str, duration: Duration) {
        self.sleep_with_threshold(name, duration, DEFAULT_IN_MEMORY_SLEEP_THRESHOLD).await;
    }

    /// [`sleep`](Self::sleep) with its own in-memory threshold.
    pub async fn sleep_with_threshold(
        &self,
        name: &str,
        duration: Duration,
        in_memory_threshold: Duration,
    ) {
        if duration.is_zero() {
            return;
        }
        let clock = format!("DurableClock/{name}");
        if duration <= in_memory_threshold {
            let slept: Result<(), Never> = self
                .reserved_activity(clock, move |_| async move {
                    tokio::time::sleep(duration).await;
                    Ok(())
                })
                .await;
            if let Err(never) = slept {
                match never {}
            }
            return;
        }
        let scheduled = self.run.engine.schedule_clock(&self.run, name, duration).await;
        if let Err(error) = scheduled {
            self.run.break_with(&error).await;
        }
        let exit = self.deferred_exit(&clock).await;
        let _: Result<(), Never> = self.settle(decode_exit(exit)).await;
    }

    /// Races `branches` (activities, deferred awaits, sleeps, or any steps): the first branch
    /// to **succeed** wins and the others are dropped; the race fails only when every branch
    /// failed (with the last failure). The outcome is recorded under `raceAll/<name>`, so a
    /// replay returns it without running any branch. When every branch is waiting on a
    /// durable completion, the run suspends; a completion then replays it.
    pub async fn race<T, E>(
        &self,
        name: &str,
        branches: Vec<BoxFuture<'_, Result<T, E>>>,
    ) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
    {
        let record = format!("raceAll/{name}");
        let run = &self.run;
        let hold = run.hold();
        match run.engine.deferred_result(run, &record).await {
            Ok(Some(exit)) => {
                hold.release();
                return self.settle(decode_exit(exit)).await;
            }
            Ok(None) => {}
            Err(error) => {
                hold.release();
                run.break_with(&error).await;
                unreachable_step()
            }
        }
        let race = Race {
            branches: branches
                .into_iter()
                .map(|branch| RaceBranch {
                    future: Some(branch),
                    record: Arc::default(),
                    failed: false,
                })
                .collect(),
            last_error: None,
        };
        let end = race.await;
        let awaits: Vec<String> = end.awaits;
        match end.outcome {
            RaceOutcome::Settled(result) => {
                // The branches' waits end with the race: a late completion does not preempt.
                run.release_awaits(&awaits);
                let exit = encode_result(result);
                run.update(|state| state.completed.insert(record.clone()));
                let token = self.token(&DurableDeferred::<(), Never>::reserved(record));
                let recorded = run.engine.deferred_done(Some(run), token, exit.clone()).await;
                hold.release();
                if let Err(error) = recorded {
                    run.break_with(&error).await;
                }
                self.settle(decode_exit(exit)).await
            }
            RaceOutcome::Parked => {
                // The waits stay registered (handed to an enclosing race, if any).
                for name in &awaits {
                    note_branch_await(name);
                }
                hold.release();
                run.suspend(None).await;
                unreachable_step()
            }
        }
    }

    /// Executes child workflow `W` and waits for its result: the child's completion wakes this
    /// execution, and an interrupt applied to this execution interrupts the child.
    pub async fn child<W: Workflow>(&self, payload: W::Payload) -> Result<W::Success, W::Error> {
        let execution_id = W::execution_id(&payload);
        self.run.engine.define(W::NAME, &W::options());
        let result = self.start(W::NAME, &execution_id, &payload, false, false).await;
        match result {
            Some(WorkflowResult::Complete(exit)) => {
                self.run.update(|state| {
                    for child in &mut state.children {
                        if child.execution_id == execution_id {
                            child.complete = true;
                        }
                    }
                });
                self.settle(decode_exit(exit)).await
            }
            Some(WorkflowResult::Suspended { cause, .. }) => {
                // A child's `failed` is not inherited.
                self.run.suspend(cause).await;
                unreachable_step()
            }
            None => {
                self.run.suspend(None).await;
                unreachable_step()
            }
        }
    }

    /// Starts child workflow `W` without waiting (discard): returns its execution id once the
    /// run is dispatched. Unless `detached`, an interrupt applied to this execution interrupts
    /// the child; a detached child is independent (and its completion never wakes this one).
    pub async fn start_child<W: Workflow>(
        &self,
        payload: W::Payload,
        detached: bool,
    ) -> ExecutionId {
        let execution_id = W::execution_id(&payload);
        self.run.engine.define(W::NAME, &W::options());
        self.start(W::NAME, &execution_id, &payload, true, detached).await;
        execution_id
    }

    async fn start<P: Serialize>(
        &self,
        workflow: &'static str,
        execution_id: &ExecutionId,
        payload: &P,
        discard: bool,
        detached: bool,
    ) -> Option<WorkflowResult> {
        let run = &self.run;
        let payload = match RawJson::encode(payload) {
            Ok(payload) => payload,
            Err(error) => {
                run.raise(crate::run::defect_cause(
                    RawJson::encode(&error.to_string()).unwrap_or_else(|_| RawJson::null()),
                ))
                .await;
                unreachable_step()
            }
        };
        if !detached {
            run.update(|state| {
                if !state.children.iter().any(|child| &child.execution_id == execution_id) {
                    state.children.push(crate::run::ChildLink {
                        workflow,
                        execution_id: execution_id.clone(),
                        complete: false,
                    });
                }
            });
        }
        let parent =
            Parent { workflow: run.workflow, execution_id: run.execution_id.clone(), detached };
        let hold = run.hold();
        let result =
            run.engine.execute(workflow, execution_id, payload, Some(parent), discard).await;
        hold.release();
        match result {
            Ok(result) => result,
            Err(error) => {
                run.break_with(&error).await;
                unreachable_step()
            }
        }
    }

    /// Registers a workflow finalizer: `finalizer` runs once, when the execution ends, with
    /// the final exit if this is the run that produced it and with success if a later run
    /// superseded this one. Not run for runs their owner abandoned (it replays elsewhere).
    pub fn add_finalizer<F, Fut>(&self, finalizer: F)
    where
        F: FnOnce(RunExit) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.run.state().finalizers.push(Box::new(move |exit| Box::pin(finalizer(exit))));
    }

    /// Runs `step`; if it succeeds, registers `compensate` to run with its value and the
    /// failure cause if (and only if) the execution fails. Compensations run in reverse
    /// registration order, exactly once, in the run that produces the failure; a replay that
    /// gets the step's stored result registers the compensation again.
    pub async fn with_compensation<T, E, Fut, C, CFut>(
        &self,
        step: Fut,
        compensate: C,
    ) -> Result<T, E>
    where
        Fut: Future<Output = Result<T, E>>,
        T: Clone + Send + 'static,
        C: FnOnce(T, FailureCause) -> CFut + Send + 'static,
        CFut: Future<Output = ()> + Send + 'static,
    {
        let out = step.await;
        if let Ok(value) = &out {
            let value = value.clone();
            self.add_finalizer(move |exit: RunExit| async move {
                if let Exit::Failure(cause) = exit.exit {
                    compensate(value, FailureCause(cause)).await;
                }
            });
        }
        out
    }
}

/// Gives run `retry` (0 first) of a transactional activity's body a clean transaction: the
/// first marks a savepoint, each retry rolls back to it.
async fn clean_start(slot: Option<&TransactionSlot>, retry: u32) -> Result<(), StorageError> {
    let Some(slot) = slot else { return Ok(()) };
    let mut transaction = slot.lock().await;
    let Some(transaction) = transaction.as_mut() else {
        return Err(StorageError::new(StorageErrorKind::Other, "the transaction already ended"));
    };
    if retry == 0 {
        transaction.savepoint().await
    } else {
        transaction.rollback_to_savepoint().await
    }
}

/// The exit of one run of an activity body: what it returned, the failure raised in it (an
/// engine failure under it is an interrupt), or `None` when it suspended.
fn activity_exit(run: &Run, end: BodyEnd) -> Option<Exit> {
    let state = run.state();
    match end {
        BodyEnd::Returned(exit) => Some(exit),
        BodyEnd::Stopped => match (&state.raised, &state.broken) {
            (Some(cause), _) => Some(Exit::Failure(cause.clone())),
            (None, Some(_)) => Some(Exit::interrupt()),
            (None, None) => None,
        },
    }
}

/// The result of an activity whose body ended with `exit`.
fn activity_result(exit: Exit, options: RunOptions) -> WorkflowResult {
    // An activity of a `suspend_on_failure` workflow suspends the execution on failure.
    if let Exit::Failure(cause) = &exit
        && options.suspend_on_failure
        && !cause.has_interrupts_only()
    {
        let cause =
            Cause(vec![cluster_core::envelope::CauseReason::Die(crate::result::squash(cause))]);
        return WorkflowResult::Suspended { cause: Some(cause), failed: true };
    }
    WorkflowResult::Complete(exit)
}

/// A step after a suspension or a raised cause never continues: the run stops and drops it.
fn unreachable_step() -> ! {
    unreachable!("a workflow step continued after its run stopped")
}

/// An awaitable activity call (see [`WorkflowContext::activity`]).
pub struct ActivityCall<'c, A, E, F> {
    context: &'c WorkflowContext,
    name: String,
    /// Why the name is refused, if it is.
    refused: Option<ReservedName>,
    body: F,
    retries: u32,
    transactional: bool,
    interrupt_retry: InterruptRetry,
    types: PhantomData<fn() -> (A, E)>,
}

impl<'c, A, E, F, Fut> ActivityCall<'c, A, E, F>
where
    A: Serialize + DeserializeOwned + Send + 'c,
    E: Serialize + DeserializeOwned + Send + 'c,
    F: Fn(ActivityContext) -> Fut + Send + Sync + 'c,
    Fut: Future<Output = Result<A, E>> + Send + 'c,
{
    /// Retries a failed attempt up to `times` more times, at once: attempts 1 to `times + 1`,
    /// each stored separately (a replay walks through the stored ones). The last error is
    /// returned when every attempt failed.
    #[must_use]
    pub fn retry(mut self, times: u32) -> Self {
        self.retries = times;
        self
    }

    /// Runs the body inside the storage transaction in which its result is saved (the
    /// reference's `ClusterSchema.WithTransaction` annotation on an activity): the body's own
    /// statements, run through the typed guard of the storage's backend on its
    /// [`ActivityContext`] (a [`TransactionSource`]), commit together with a successful
    /// result, and roll back if the result is not saved (the owner dies or loses the shard, the
    /// commit fails), if the body fails (its failure is then saved on its own), or if it
    /// suspends. On the in-memory engine there is no transaction and this does nothing.
    #[must_use]
    pub fn with_transaction(mut self) -> Self {
        self.transactional = true;
        self
    }

    /// How a body cut off by an interrupt runs again ([`InterruptRetry::default`], the
    /// reference's policy, unless set).
    #[must_use]
    pub fn interrupt_retry(mut self, policy: InterruptRetry) -> Self {
        self.interrupt_retry = policy;
        self
    }

    /// Registers `compensate` for the activity's value once it succeeded (see
    /// [`WorkflowContext::with_compensation`]).
    pub fn compensate<C, CFut>(self, compensate: C) -> BoxFuture<'c, Result<A, E>>
    where
        A: Clone + 'static,
        C: FnOnce(A, FailureCause) -> CFut + Send + 'static,
        CFut: Future<Output = ()> + Send + 'static,
    {
        let context = self.context;
        Box::pin(async move { context.with_compensation(self.into_future(), compensate).await })
    }

    /// Returns a defect of the activity (a panic, an undecodable value) as
    /// [`ActivityError::Defect`] instead of ending the run with it.
    pub fn catch_defects(self) -> BoxFuture<'c, Result<A, ActivityError<E>>> {
        Box::pin(async move {
            match self.attempts().await {
                Decoded::Ok(value) => Ok(value),
                Decoded::Fail(error) => Err(ActivityError::Failed(error)),
                Decoded::Raise(cause) if !cause.has_interrupts_only() => {
                    Err(ActivityError::Defect(
                        FailureCause(cause).defect().unwrap_or("null").to_owned(),
                    ))
                }
                Decoded::Raise(cause) => {
                    self.context.run.raise(cause).await;
                    unreachable_step()
                }
            }
        })
    }

    async fn attempts(&self) -> Decoded<A, E> {
        if let Some(refused) = &self.refused {
            let defect = RawJson::encode(&refused.to_string()).unwrap_or_else(|_| RawJson::null());
            return Decoded::Raise(crate::run::defect_cause(defect));
        }
        let mut attempt = 1;
        loop {
            let step =
                ActivityStep { name: &self.name, attempt, transactional: self.transactional };
            let decoded =
                self.context.activity_attempt(step, self.interrupt_retry, &self.body).await;
            match decoded {
                Decoded::Fail(error) if attempt <= self.retries => {
                    drop(error);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}

impl<'c, A, E, F, Fut> IntoFuture for ActivityCall<'c, A, E, F>
where
    A: Serialize + DeserializeOwned + Send + 'c,
    E: Serialize + DeserializeOwned + Send + 'c,
    F: Fn(ActivityContext) -> Fut + Send + Sync + 'c,
    Fut: Future<Output = Result<A, E>> + Send + 'c,
{
    type Output = Result<A, E>;
    type IntoFuture = BoxFuture<'c, Result<A, E>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            let decoded = self.attempts().await;
            self.context.settle(decoded).await
        })
    }
}

/// An activity's failure when its defects are caught.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActivityError<E> {
    /// The activity's own error.
    #[error("the activity failed")]
    Failed(E),
    /// The activity died; the defect's JSON.
    #[error("the activity died: {0}")]
    Defect(String),
}

struct RaceBranch<'a, T, E> {
    future: Option<BoxFuture<'a, Result<T, E>>>,
    record: Arc<Mutex<Branch>>,
    failed: bool,
}

struct Race<'a, T, E> {
    branches: Vec<RaceBranch<'a, T, E>>,
    last_error: Option<E>,
}

enum RaceOutcome<T, E> {
    Settled(Result<T, E>),
    Parked,
}

struct RaceEnd<T, E> {
    outcome: RaceOutcome<T, E>,
    awaits: Vec<String>,
}

// The race never projects a pin onto its fields (the branches are boxed futures).
impl<T, E> Unpin for Race<'_, T, E> {}

impl<T, E> Race<'_, T, E> {
    fn awaits(&self) -> Vec<String> {
        self.branches.iter().flat_map(|branch| lock(&branch.record).awaits.clone()).collect()
    }
}

impl<T, E> Future for Race<'_, T, E> {
    type Output = RaceEnd<T, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RaceEnd<T, E>> {
        let this = self.get_mut();
        for index in 0..this.branches.len() {
            let branch = &mut this.branches[index];
            let Some(future) = branch.future.as_mut() else { continue };
            if lock(&branch.record).parked {
                continue;
            }
            match in_branch(&branch.record, || future.as_mut().poll(cx)) {
                Poll::Ready(Ok(value)) => {
                    let awaits = this.awaits();
                    // The losers are dropped (interrupted) here.
                    for branch in &mut this.branches {
                        branch.future = None;
                    }
                    return Poll::Ready(RaceEnd {
                        outcome: RaceOutcome::Settled(Ok(value)),
                        awaits,
                    });
                }
                Poll::Ready(Err(error)) => {
                    branch.future = None;
                    branch.failed = true;
                    this.last_error = Some(error);
                }
                Poll::Pending => {}
            }
        }
        if this.branches.iter().all(|branch| branch.failed) {
            let awaits = this.awaits();
            return match this.last_error.take() {
                Some(error) => {
                    Poll::Ready(RaceEnd { outcome: RaceOutcome::Settled(Err(error)), awaits })
                }
                // A race of no branches never settles: it parks.
                None => Poll::Ready(RaceEnd { outcome: RaceOutcome::Parked, awaits }),
            };
        }
        let parked =
            this.branches.iter().all(|branch| branch.failed || lock(&branch.record).parked);
        if parked {
            return Poll::Ready(RaceEnd { outcome: RaceOutcome::Parked, awaits: this.awaits() });
        }
        Poll::Pending
    }
}
