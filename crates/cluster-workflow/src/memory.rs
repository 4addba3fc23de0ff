//! The in-memory engine (the reference's `WorkflowEngine.layerMemory`,
//! `effect/src/workflow/WorkflowEngine.ts`): executions, activity results and deferred completions
//! live in this process only. For tests, examples and single-process tools; the cluster engine is
//! the durable one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use cluster_core::envelope::{Cause, Exit, RawJson};
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

use crate::context::WorkflowContext;
use crate::engine::{
    ActivityBody, ActivityStep, Backend, Ending, Parent, Registration, ResumeMode, RunOutcome,
    Scope, WorkflowEngine, WorkflowError, ending, finish_run, retain_scope,
};
use crate::id::{ExecutionId, Token};
use crate::result::{WorkflowResult, interrupt_reason};
use crate::run::{BodyEnd, Run, RunKind, RunOptions, drive};

/// What the latest run of an execution left.
#[derive(Clone, Debug)]
enum Latest {
    Result(WorkflowResult),
    NoResult(Cause),
    /// The engine shut down under the run.
    Aborted,
}

enum ActivitySlot {
    Running(Arc<Notify>),
    Done(Exit),
}

struct Execution {
    workflow: &'static str,
    payload: RawJson,
    parent: Option<Parent>,
    interrupted: bool,
    interrupted_unsafe: bool,
    running: Option<Arc<Run>>,
    resume_requested: Option<ResumeMode>,
    latest: Option<Latest>,
    finished_runs: watch::Sender<u64>,
    retained: Vec<Scope>,
}

/// A durable queue of the in-memory engine.
#[derive(Default)]
struct Queue {
    items: std::collections::VecDeque<(Token, RawJson)>,
    offered: BTreeSet<String>,
    has_worker: bool,
    ready: Arc<Notify>,
}

#[derive(Default)]
struct Shared {
    queues: BTreeMap<String, Queue>,
    workflows: BTreeMap<&'static str, Registration>,
    executions: BTreeMap<ExecutionId, Execution>,
    activities: BTreeMap<(ExecutionId, String, u32), ActivitySlot>,
    deferreds: BTreeMap<(ExecutionId, String), Exit>,
    clocks: BTreeSet<(ExecutionId, String)>,
    shut_down: bool,
}

/// The in-memory engine.
pub(crate) struct MemoryEngine {
    me: Weak<MemoryEngine>,
    shared: Mutex<Shared>,
    tasks: Mutex<JoinSet<()>>,
}

impl WorkflowEngine {
    /// A new in-memory engine. Runs are tokio tasks of the current runtime.
    pub fn memory() -> WorkflowEngine {
        let engine = Arc::new_cyclic(|me| MemoryEngine {
            me: me.clone(),
            shared: Mutex::new(Shared::default()),
            tasks: Mutex::new(JoinSet::new()),
        });
        WorkflowEngine { backend: engine, _runtime: None }
    }
}

impl MemoryEngine {
    fn shared(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    fn arc(&self) -> Option<Arc<MemoryEngine>> {
        self.me.upgrade()
    }

    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut tasks = lock(&self.tasks);
        while tasks.try_join_next().is_some() {}
        tasks.spawn(task);
    }

    /// Starts a run of `execution_id` (the caller holds the lock and checked it is not running).
    fn start_run(&self, shared: &mut Shared, execution_id: &ExecutionId) {
        let Some(engine) = self.arc() else { return };
        let Some(execution) = shared.executions.get_mut(execution_id) else { return };
        let Some(registration) = shared.workflows.get(execution.workflow).cloned() else { return };
        let options = RunOptions {
            capture_defects: registration.options.capture_defects,
            suspend_on_failure: registration.options.suspend_on_failure,
        };
        let backend: Arc<dyn Backend> = engine.clone();
        let run =
            Run::new(registration.name, execution_id.clone(), RunKind::Body, options, backend);
        execution.running = Some(Arc::clone(&run));
        let payload = execution.payload.clone();
        tracing::debug!(workflow = registration.name, %execution_id, "workflow run started");
        self.spawn(async move { engine.run_once(registration, run, payload).await });
    }

    async fn run_once(
        self: Arc<Self>,
        registration: Registration,
        run: Arc<Run>,
        payload: RawJson,
    ) {
        let context = WorkflowContext::new(Arc::clone(&run));
        let end = drive(&run, (registration.body)(context, payload)).await;
        self.apply_interrupt(&run, &end);
        let execution_id = run.execution_id.clone();
        let (outcome, children) = finish_run(&run, &end, |own| {
            let mut shared = self.shared();
            shared
                .executions
                .get_mut(&execution_id)
                .map_or_else(Vec::new, |execution| retain_scope(&mut execution.retained, own))
        })
        .await;
        // The interrupt link: children not complete are interrupted with their parent.
        for child in &children {
            let _ = self.interrupt(child.workflow, &child.execution_id, false).await;
        }
        let mut shared = self.shared();
        let Some(execution) = shared.executions.get_mut(&execution_id) else { return };
        execution.running = None;
        execution.latest = Some(match &outcome {
            RunOutcome::Result(result) => Latest::Result(result.clone()),
            RunOutcome::NoResult(cause) => Latest::NoResult(cause.clone()),
        });
        execution.finished_runs.send_modify(|runs| *runs += 1);
        tracing::debug!(workflow = run.workflow, %execution_id, ?outcome, "workflow run ended");
        let parent = execution.parent.clone();
        let requested = execution.resume_requested.take();
        if let Some(mode) = requested {
            self.resume_locked(&mut shared, &execution_id, mode);
        }
        // A child's completion wakes its parent, an interrupted child's too (the recommended
        // answer to Appendix C #1).
        if let (RunOutcome::Result(WorkflowResult::Complete(_)), Some(parent)) = (&outcome, parent)
            && !parent.detached
        {
            self.resume_locked(&mut shared, &parent.execution_id, ResumeMode::Automatic);
        }
    }

    /// The memory engine's `onExit`: a pending interrupt is applied when the run suspended,
    /// failed under `suspend_on_failure`, or the interrupt is a hard one.
    fn apply_interrupt(&self, run: &Run, end: &BodyEnd) {
        let (interrupted, hard) = {
            let shared = self.shared();
            shared.executions.get(&run.execution_id).map_or((false, false), |execution| {
                (execution.interrupted, execution.interrupted_unsafe)
            })
        };
        if !interrupted {
            return;
        }
        let Ending { suspended, failed_under_sof } = ending(run, end);
        if hard || suspended || failed_under_sof {
            run.update(|state| {
                state.interrupted = true;
                state.suspended = false;
            });
        }
    }

    /// The internal wake (the caller holds the lock).
    fn resume_locked(&self, shared: &mut Shared, execution_id: &ExecutionId, mode: ResumeMode) {
        let Some(execution) = shared.executions.get_mut(execution_id) else { return };
        if execution.running.is_some() {
            execution.resume_requested = execution.resume_requested.max(Some(mode));
            return;
        }
        match &execution.latest {
            Some(Latest::Result(WorkflowResult::Suspended { failed, .. })) => {
                if *failed && mode == ResumeMode::Automatic {
                    return;
                }
            }
            Some(Latest::NoResult(_)) => {}
            _ => return,
        }
        self.start_run(shared, execution_id);
    }

    fn deferred_key(execution_id: &ExecutionId, name: &str) -> (ExecutionId, String) {
        (execution_id.clone(), name.to_owned())
    }
}

/// Clears an activity slot still marked running when its attempt ends or is dropped.
struct SlotGuard<'a> {
    engine: &'a MemoryEngine,
    key: (ExecutionId, String, u32),
    notify: Arc<Notify>,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let mut shared = self.engine.shared();
        if matches!(shared.activities.get(&self.key), Some(ActivitySlot::Running(_))) {
            shared.activities.remove(&self.key);
        }
        drop(shared);
        self.notify.notify_waiters();
    }
}

impl Backend for MemoryEngine {
    fn register(&self, registration: Registration) -> Result<(), WorkflowError> {
        let mut shared = self.shared();
        if shared.workflows.contains_key(registration.name) {
            return Err(WorkflowError::Invalid(format!(
                "workflow {} is already registered",
                registration.name
            )));
        }
        shared.workflows.insert(registration.name, registration);
        Ok(())
    }

    fn activity<'a>(
        &'a self,
        run: &'a Arc<Run>,
        step: ActivityStep<'a>,
        execute: ActivityBody<'a>,
    ) -> BoxFuture<'a, Result<WorkflowResult, WorkflowError>> {
        // No storage, so no transaction: a transactional activity runs as any other.
        let ActivityStep { name, attempt, transactional: _ } = step;
        Box::pin(async move {
            let key = (run.execution_id.clone(), name.to_owned(), attempt);
            let notify = loop {
                let waiting = {
                    let mut shared = self.shared();
                    match shared.activities.get(&key) {
                        Some(ActivitySlot::Done(exit)) => {
                            return Ok(WorkflowResult::Complete(exit.clone()));
                        }
                        // Another call of the same activity runs it: wait for its result.
                        Some(ActivitySlot::Running(notify)) => Arc::clone(notify).notified_owned(),
                        None => {
                            let pending_interrupt = shared
                                .executions
                                .get(&run.execution_id)
                                .is_some_and(|execution| execution.interrupted);
                            if pending_interrupt && !run.state().interrupted {
                                // A pending interrupt starts no new activity.
                                return Ok(WorkflowResult::suspended());
                            }
                            let notify = Arc::new(Notify::new());
                            let slot = ActivitySlot::Running(Arc::clone(&notify));
                            shared.activities.insert(key.clone(), slot);
                            break notify;
                        }
                    }
                };
                waiting.await;
            };
            let guard = SlotGuard { engine: self, key: key.clone(), notify };
            let activity_run = Run::new(
                run.workflow,
                run.execution_id.clone(),
                RunKind::Activity(attempt),
                run.options,
                Arc::clone(&run.engine),
            );
            let interrupted = run.state().interrupted;
            activity_run.update(|state| state.interrupted = interrupted);
            let result = execute(activity_run, None).await;
            if let WorkflowResult::Complete(exit) = &result {
                let interrupt_only =
                    matches!(exit, Exit::Failure(cause) if cause.has_interrupts_only());
                if !interrupt_only {
                    self.shared().activities.insert(key, ActivitySlot::Done(exit.clone()));
                }
            }
            drop(guard);
            Ok(result)
        })
    }

    fn deferred_result<'a>(
        &'a self,
        run: &'a Arc<Run>,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Exit>, WorkflowError>> {
        let exit =
            self.shared().deferreds.get(&Self::deferred_key(&run.execution_id, name)).cloned();
        Box::pin(std::future::ready(Ok(exit)))
    }

    fn deferred_done<'a>(
        &'a self,
        from: Option<&'a Arc<Run>>,
        token: Token,
        exit: Exit,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        let mut shared = self.shared();
        if shared.shut_down {
            return Box::pin(std::future::ready(Err(WorkflowError::ShutDown)));
        }
        let key = Self::deferred_key(&token.execution_id, &token.deferred);
        if shared.deferreds.contains_key(&key) {
            // The first completion wins.
            return Box::pin(std::future::ready(Ok(())));
        }
        shared.deferreds.insert(key, exit);
        tracing::debug!(execution_id = %token.execution_id, deferred = %token.deferred, "deferred completed");
        if let Some(running) = shared
            .executions
            .get(&token.execution_id)
            .and_then(|execution| execution.running.clone())
        {
            let from_this_run = from.is_some_and(|from| Arc::ptr_eq(from, &running));
            if !from_this_run && running.awaits(&token.deferred) {
                running.preempt();
            }
        }
        let own = from.is_some_and(|from| {
            from.execution_id == token.execution_id
                && from.state().completed.contains(&token.deferred)
        });
        if !own {
            self.resume_locked(&mut shared, &token.execution_id, ResumeMode::Automatic);
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn schedule_clock<'a>(
        &'a self,
        run: &'a Arc<Run>,
        clock: &'a str,
        duration: Duration,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        let key = (run.execution_id.clone(), clock.to_owned());
        let fresh = self.shared().clocks.insert(key);
        if fresh && let Some(engine) = self.arc() {
            let token = Token {
                workflow: run.workflow.to_owned(),
                execution_id: run.execution_id.clone(),
                deferred: format!("DurableClock/{clock}"),
            };
            self.spawn(async move {
                tokio::time::sleep(duration).await;
                let _ = engine.deferred_done(None, token, Exit::void()).await;
            });
        }
        Box::pin(std::future::ready(Ok(())))
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
            let mut finished = {
                let mut shared = self.shared();
                if shared.shut_down {
                    return Err(WorkflowError::ShutDown);
                }
                let Some(registration) = shared.workflows.get(workflow) else {
                    return Err(WorkflowError::NotRegistered(workflow.to_owned()));
                };
                let name = registration.name;
                if !shared.executions.contains_key(execution_id) {
                    let execution = Execution {
                        workflow: name,
                        payload,
                        parent: parent.filter(|parent| !parent.detached),
                        interrupted: false,
                        interrupted_unsafe: false,
                        running: None,
                        resume_requested: None,
                        latest: None,
                        finished_runs: watch::Sender::new(0),
                        retained: Vec::new(),
                    };
                    shared.executions.insert(execution_id.clone(), execution);
                    self.start_run(&mut shared, execution_id);
                }
                if discard {
                    return Ok(None);
                }
                let Some(execution) = shared.executions.get(execution_id) else { return Ok(None) };
                let mut finished = execution.finished_runs.subscribe();
                if execution.running.is_none() {
                    finished.mark_unchanged();
                    None
                } else {
                    finished.mark_unchanged();
                    Some(finished)
                }
            };
            if let Some(finished) = finished.as_mut()
                && finished.changed().await.is_err()
            {
                return Err(WorkflowError::ShutDown);
            }
            let shared = self.shared();
            match shared.executions.get(execution_id).and_then(|execution| execution.latest.clone())
            {
                Some(Latest::Result(result)) => Ok(Some(result)),
                Some(Latest::NoResult(cause)) => Err(WorkflowError::NoResult(cause)),
                Some(Latest::Aborted) => Ok(Some(WorkflowResult::Complete(Exit::interrupt()))),
                None => Ok(None),
            }
        })
    }

    fn execution_exists<'a>(
        &'a self,
        _workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<bool, WorkflowError>> {
        let exists = self.shared().executions.contains_key(execution_id);
        Box::pin(std::future::ready(Ok(exists)))
    }

    fn poll<'a>(
        &'a self,
        _workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<Option<WorkflowResult>, WorkflowError>> {
        let shared = self.shared();
        let polled = match shared.executions.get(execution_id) {
            None => Ok(None),
            Some(execution) if execution.running.is_some() => Ok(None),
            Some(execution) => match execution.latest.clone() {
                Some(Latest::Result(result)) => Ok(Some(result)),
                Some(Latest::NoResult(cause)) => Err(WorkflowError::NoResult(cause)),
                Some(Latest::Aborted) => Err(WorkflowError::ShutDown),
                None => Ok(None),
            },
        };
        Box::pin(std::future::ready(polled))
    }

    fn interrupt<'a>(
        &'a self,
        _workflow: &'a str,
        execution_id: &'a ExecutionId,
        hard: bool,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        let mut shared = self.shared();
        if let Some(execution) = shared.executions.get_mut(execution_id) {
            let complete =
                matches!(execution.latest, Some(Latest::Result(WorkflowResult::Complete(_))));
            if !complete {
                execution.interrupted = true;
                if hard {
                    execution.interrupted_unsafe = true;
                    if let Some(running) = &execution.running {
                        running.update(|state| {
                            state.raised.get_or_insert_with(|| Cause(vec![interrupt_reason()]));
                        });
                    }
                }
                self.resume_locked(&mut shared, execution_id, ResumeMode::Explicit);
            }
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn resume<'a>(
        &'a self,
        _workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        let mut shared = self.shared();
        self.resume_locked(&mut shared, execution_id, ResumeMode::Explicit);
        Box::pin(std::future::ready(Ok(())))
    }

    fn await_complete<'a>(
        &'a self,
        _workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            loop {
                let watched = {
                    let shared = self.shared();
                    shared.executions.get(execution_id).map(|execution| {
                        let complete = matches!(
                            execution.latest,
                            Some(Latest::Result(WorkflowResult::Complete(_)))
                        );
                        let mut finished = execution.finished_runs.subscribe();
                        finished.mark_unchanged();
                        (complete, finished)
                    })
                };
                let Some((complete, mut finished)) = watched else {
                    return std::future::pending().await;
                };
                if complete {
                    return;
                }
                if finished.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        })
    }

    fn define(&self, _workflow: &'static str, _options: &crate::definition::WorkflowOptions) {}

    fn offer<'a>(
        &'a self,
        queue: &'a str,
        item_id: &'a str,
        token: Token,
        payload: RawJson,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        let mut shared = self.shared();
        let queue = shared.queues.entry(queue.to_owned()).or_default();
        if queue.offered.insert(item_id.to_owned()) {
            queue.items.push_back((token, payload));
            queue.ready.notify_one();
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn register_queue_worker(
        &self,
        queue: &'static str,
        worker: crate::engine::QueueWorker,
    ) -> Result<(), WorkflowError> {
        let ready = {
            let mut shared = self.shared();
            let state = shared.queues.entry(queue.to_owned()).or_default();
            if state.has_worker {
                return Err(WorkflowError::Invalid(format!("queue {queue} already has a worker")));
            }
            state.has_worker = true;
            Arc::clone(&state.ready)
        };
        let Some(engine) = self.arc() else { return Err(WorkflowError::ShutDown) };
        let concurrency = usize::try_from(worker.concurrency.get()).unwrap_or(usize::MAX);
        let permits = Arc::new(tokio::sync::Semaphore::new(concurrency));
        // The dispatcher: each item runs in a task of its own, at most `concurrency` at once,
        // and completes its deferred.
        self.spawn(async move {
            loop {
                let Ok(permit) = Arc::clone(&permits).acquire_owned().await else { return };
                let item =
                    engine.shared().queues.get_mut(queue).and_then(|state| state.items.pop_front());
                let Some((token, payload)) = item else {
                    drop(permit);
                    ready.notified().await;
                    continue;
                };
                let (engine_for_item, run) = (Arc::clone(&engine), Arc::clone(&worker.run));
                engine.spawn(async move {
                    let _permit = permit;
                    let exit = run(payload)
                        .await
                        .unwrap_or_else(|error| Exit::die_with_message("MalformedPayload", &error));
                    if let Err(error) = engine_for_item.deferred_done(None, token, exit).await {
                        tracing::warn!(%error, "could not complete a queue item");
                    }
                });
            }
        });
        Ok(())
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            {
                let mut shared = self.shared();
                shared.shut_down = true;
            }
            let mut tasks = std::mem::take(&mut *lock(&self.tasks));
            tasks.shutdown().await;
            let mut shared = self.shared();
            for execution in shared.executions.values_mut() {
                if execution.running.take().is_some() {
                    execution.latest = Some(Latest::Aborted);
                    execution.finished_runs.send_modify(|runs| *runs += 1);
                }
            }
        })
    }
}
