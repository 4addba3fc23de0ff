//! Activations: one lifetime of an execution's entity on this runner, and the workflow and
//! clock entities that hold them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cluster_core::backoff::Backoff;
use cluster_core::envelope::Exit;
use cluster_core::sync::lock;
use cluster_sharding::{
    Entity, EntityContext, Protocol, RequestContext, SharedHandler, TransactionSlot,
};
use tokio::sync::{oneshot, watch};

use super::requests::{
    ActivityRpc, ClockRpc, DeferredRpc, ExitJson, ParentJson, ResultJson, ResumeRpc, RunRpc,
};
use super::{Abandoned, CLOCK_ENTITY, ClusterEngine, INTERRUPT_SIGNAL, INTERRUPT_UNSAFE, abandon};
use crate::context::{Never, WorkflowContext};
use crate::engine::{
    Backend, Ending, Registration, ResumeMode, RunOutcome, Scope, WorkflowError, close_run, ending,
    retain_scope, run_outcome,
};
use crate::id::{ExecutionId, Token};
use crate::result::WorkflowResult;
use crate::run::{Awaits, BodyEnd, ChildLink, Run, RunKind, RunOptions, drive};

/// The channel a caller hands to the `activity` handler: the handler sends back where the
/// activity's result goes once the caller has run it, and the request's storage transaction.
pub(super) type ActivityGo = oneshot::Sender<ActivityStart>;

/// The `activity` handler's go to the caller that runs the body.
pub(super) struct ActivityStart {
    /// Where the body's result goes.
    pub(super) done: oneshot::Sender<WorkflowResult>,
    /// The storage transaction the result is saved in, for a transactional activity.
    pub(super) transaction: Option<TransactionSlot>,
}

/// What one activation knows of its execution, under one lock.
///
/// # Invariants
///
/// - A run is current only once the stored interrupt signal was loaded (`current` implies
///   `loaded`): no run misses an interrupt stored before this activation began.
/// - An activity key is in `activities` while its caller waits for the handler's go, and in
///   `aborted` once its caller went away while it ran.
///   The handler's arrival takes it out of both; so does the caller's end.
/// - `reply_pending` is set when a run ends.
///   Only a wake that saw that run's reply clears it, and only if no run started or ended
///   since.
/// - `completed_here` and `results` only grow: a deferred completed once stays completed.
#[derive(Default)]
pub(super) struct ActivationState {
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

impl ActivationState {
    /// A stored interrupt signal's completion, seen here before its delivery (its value is
    /// always `void`, so the cache cannot disagree with the first completion stored).
    pub(super) fn stored_signal(&mut self, signal: &str) {
        self.results.entry(signal.to_owned()).or_insert_with(Exit::void);
    }

    /// A run starts: it is current, with no activity waits yet.
    fn start_run(&mut self, run: Arc<Run>) {
        self.current = Some(run);
        self.activity_awaits = Awaits::default();
        self.check();
    }

    /// `run` ended: its reply is pending, and the deferreds it completed wake nothing here.
    fn end_run(&mut self, run: &Arc<Run>, completed: BTreeSet<String>) {
        self.completed_here.extend(completed);
        self.reply_pending = true;
        if self.current.as_ref().is_some_and(|current| Arc::ptr_eq(current, run)) {
            self.current = None;
        }
        self.check();
    }

    /// A caller of activity `key` waits for the handler's go on `go`.
    pub(super) fn wait_for_go(&mut self, key: (String, u32), go: ActivityGo) {
        self.activities.insert(key, go);
    }

    /// The activity handler arrived for `key`: the go of the caller that waits, if one does.
    fn take_go(&mut self, key: &(String, u32)) -> Option<ActivityGo> {
        self.aborted.remove(key);
        self.activities.remove(key)
    }

    /// The caller of activity `key` went away while it ran.
    fn abort(&mut self, key: (String, u32)) {
        self.aborted.insert(key);
    }

    /// The caller of activity `key` has its reply: whether the body did not run for it (no
    /// handler took its go, or the caller left while it ran).
    pub(super) fn not_run(&mut self, key: &(String, u32)) -> bool {
        let waiting = self.activities.remove(key).is_some();
        waiting || self.aborted.remove(key)
    }

    /// The waits of the current run's activities.
    pub(super) fn activity_awaits(&self) -> Awaits {
        self.activity_awaits.clone()
    }

    fn check(&self) {
        debug_assert!(
            self.current.is_none() || self.loaded,
            "a run is current before the stored interrupt signal was loaded"
        );
    }
}

pub(super) struct Activation {
    engine: Arc<ClusterEngine>,
    registration: Option<Registration>,
    workflow: String,
    execution_id: ExecutionId,
    state: Mutex<ActivationState>,
    /// Counts finished runs.
    pub(super) runs: watch::Sender<u64>,
    /// The automatic-wake gate: concurrent automatic wakes merge into one.
    waking: AtomicBool,
}

impl Activation {
    pub(super) fn state(&self) -> MutexGuard<'_, ActivationState> {
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

    pub(super) fn interrupt_cached(&self) -> bool {
        self.state().results.contains_key(INTERRUPT_SIGNAL)
    }

    pub(super) async fn deferred(&self, name: &str) -> Result<Option<Exit>, WorkflowError> {
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
            state.start_run(Arc::clone(&run));
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
pub(super) struct CurrentRun {
    activation: Arc<Activation>,
    run: Arc<Run>,
    done: bool,
}

impl Drop for CurrentRun {
    fn drop(&mut self) {
        {
            let mut state = self.activation.state();
            if !self.done {
                let (finalizers, abandoned) = {
                    let mut run = self.run.state();
                    (std::mem::take(&mut run.finalizers), run.abandoned)
                };
                state.retained.push((finalizers, abandoned));
            }
            let completed = self.run.state().completed.clone();
            state.end_run(&self.run, completed);
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
    pub(super) fn activate(context: &EntityContext, engine: Arc<ClusterEngine>) -> WorkflowEntity {
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
            state.take_go(&key)
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
        self.activation.state().abort(key);
        Ok(ResultJson(settle_transaction(context, WorkflowResult::suspended()).await))
    }
}

/// Rolls a transactional activity's writes back unless it succeeded: only a success commits
/// with its stored result. A failure or a suspension is saved after the rollback, outside the
/// transaction, so that a failed attempt leaves no writes behind (its retry starts clean) and a
/// suspended body that runs again from its start does not write twice.
pub(super) async fn settle_transaction(
    context: &RequestContext,
    result: WorkflowResult,
) -> WorkflowResult {
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
    pub(super) fn new(context: &EntityContext, engine: Arc<ClusterEngine>) -> ClockEntity {
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
