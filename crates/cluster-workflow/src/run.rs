//! One run of a workflow body (or of an activity body): its state — the reference's
//! `WorkflowInstance` — and the driver that polls the body until it finishes or must stop.
//!
//! The engine owns the body's future and drops it at a suspension or an interrupt point:
//! a context call that cannot go on (a deferred without a completion, a
//! suspended activity or child, a defect) records why in the run and stays pending; the driver
//! sees the stop condition and drops the body, whose locals' `Drop` then run (the body
//! finalizers). A suspension waits until no activity is in flight, so that concurrent
//! activities finish and record their results first.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard};

use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson};
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use futures_util::FutureExt;
use tokio::sync::Notify;

use crate::engine::{Backend, WorkflowError};
use crate::id::ExecutionId;
use crate::result::FailureCause;

/// What a workflow-scope finalizer gets when its run's scope closes.
#[derive(Clone, Debug)]
pub struct RunExit {
    /// The exit the scope closed with: the execution's final exit for the run that produced
    /// it, success for runs it superseded.
    pub exit: Exit,
    /// Whether an interrupt was applied in this run.
    pub interrupted: bool,
}

impl RunExit {
    /// The failure, if the scope closed with one.
    pub fn failure(&self) -> Option<FailureCause> {
        match &self.exit {
            Exit::Failure(cause) => Some(FailureCause(cause.clone())),
            Exit::Success(_) => None,
        }
    }
}

/// A workflow-scope finalizer: runs once, when its run's scope closes.
pub(crate) type Finalizer = Box<dyn FnOnce(RunExit) -> BoxFuture<'static, ()> + Send>;

/// What a run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RunKind {
    /// A run of the workflow body.
    Body,
    /// A run of an activity body, with its attempt.
    Activity(u32),
}

/// A child execution started by a run, for the interrupt link (`effect/src/workflow/Workflow.ts`).
#[derive(Clone, Debug)]
pub(crate) struct ChildLink {
    pub(crate) workflow: &'static str,
    pub(crate) execution_id: ExecutionId,
    pub(crate) complete: bool,
}

/// The mutable state of a run.
#[derive(Default)]
pub(crate) struct RunState {
    /// The run asked to suspend (it stops once nothing is in flight).
    pub(crate) suspended: bool,
    /// A completion the run awaited arrived: it stops at once and replays.
    pub(crate) preempted: bool,
    /// An interrupt is applied to this run.
    pub(crate) interrupted: bool,
    /// The owner gave the run up (cluster): durable finalizers are skipped.
    pub(crate) abandoned: bool,
    /// This execution's own `suspend_on_failure` (or an activity's) fired.
    pub(crate) failed: bool,
    /// The accumulated suspension cause.
    pub(crate) cause: Option<Cause>,
    /// A failure raised out of band (a defect or an interrupt re-raised from a step's exit):
    /// the run stops at once and ends with it.
    pub(crate) raised: Option<Cause>,
    /// Deferreds this run completed itself.
    pub(crate) completed: BTreeSet<String>,
    /// Activities, child calls and deferred reads in flight.
    pub(crate) in_flight: u32,
    /// The run's workflow scope.
    pub(crate) finalizers: Vec<Finalizer>,
    /// Children started by this run.
    pub(crate) children: Vec<ChildLink>,
    /// The driver has finished with the body.
    pub(crate) finished: bool,
    /// The engine failed under the run (storage unreachable): the run stops with no result,
    /// to be replayed later.
    pub(crate) broken: Option<String>,
}

/// The workflow options a run applies.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunOptions {
    pub(crate) capture_defects: bool,
    pub(crate) suspend_on_failure: bool,
}

/// Live waits per deferred name (the reference's `awaitedDeferreds`). The cluster engine's
/// activity runs share one with the other activities of their workflow run, which keeps it
/// after they end (the reference's `activityAwaits` in
/// `effect/src/cluster/ClusterWorkflowEngine.ts`).
#[derive(Clone, Default)]
pub(crate) struct Awaits(Arc<Mutex<BTreeMap<String, u32>>>);

impl Awaits {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, u32>> {
        lock(&self.0)
    }

    /// Whether a live wait for `name` exists.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.lock().get(name).is_some_and(|count| *count > 0)
    }
}

/// One run: the reference's `WorkflowInstance`.
pub(crate) struct Run {
    pub(crate) workflow: &'static str,
    pub(crate) execution_id: ExecutionId,
    pub(crate) kind: RunKind,
    pub(crate) options: RunOptions,
    pub(crate) engine: Arc<dyn Backend>,
    state: Mutex<RunState>,
    awaited: Awaits,
    changed: Notify,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run")
            .field("workflow", &self.workflow)
            .field("execution_id", &self.execution_id)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Run {
    pub(crate) fn new(
        workflow: &'static str,
        execution_id: ExecutionId,
        kind: RunKind,
        options: RunOptions,
        engine: Arc<dyn Backend>,
    ) -> Arc<Run> {
        if matches!(kind, RunKind::Body) {
            crate::metrics::run_started(workflow);
        }
        Run::with_awaits(workflow, execution_id, kind, options, engine, Awaits::default())
    }

    /// A run whose waits are recorded in `awaited`, which may outlive it.
    pub(crate) fn with_awaits(
        workflow: &'static str,
        execution_id: ExecutionId,
        kind: RunKind,
        options: RunOptions,
        engine: Arc<dyn Backend>,
        awaited: Awaits,
    ) -> Arc<Run> {
        Arc::new(Run {
            workflow,
            execution_id,
            kind,
            options,
            engine,
            state: Mutex::new(RunState::default()),
            awaited,
            changed: Notify::new(),
        })
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, RunState> {
        lock(&self.state)
    }

    /// Changes the state and wakes the driver.
    pub(crate) fn update<T>(&self, change: impl FnOnce(&mut RunState) -> T) -> T {
        let out = change(&mut self.state());
        self.changed.notify_waiters();
        out
    }

    /// Asks the run to suspend, accumulating `cause`. Inside a race branch only that branch
    /// parks (its race suspends the run once every branch is parked). Returns a future that
    /// never completes: the caller's step does not go on.
    pub(crate) fn suspend(&self, cause: Option<Cause>) -> std::future::Pending<()> {
        self.update(|state| {
            if let Some(cause) = cause {
                let merged = match state.cause.take() {
                    Some(Cause(mut reasons)) => {
                        reasons.extend(cause.0);
                        Cause(reasons)
                    }
                    None => cause,
                };
                state.cause = Some(merged);
            }
            if !park_current_branch() {
                state.suspended = true;
            }
        });
        std::future::pending()
    }

    /// Ends the run at once with `cause` (a defect or an interrupt re-raised from a step).
    pub(crate) fn raise(&self, cause: Cause) -> std::future::Pending<()> {
        self.update(|state| {
            if state.raised.is_none() {
                state.raised = Some(cause);
            }
        });
        std::future::pending()
    }

    /// The engine failed under the run: it stops with no result (replayed later). A failure
    /// that a replay would meet again ([`WorkflowError::is_permanent`], such as a value over the
    /// storage's limit) ends the run with a defect instead, which names it.
    pub(crate) fn break_with(&self, error: &WorkflowError) -> std::future::Pending<()> {
        // The error with its causes: "the cluster failed: …" alone names no cause.
        let message =
            std::iter::successors(Some(error as &dyn std::error::Error), |error| error.source())
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(": ");
        if error.is_permanent() {
            tracing::warn!(execution_id = %self.execution_id, error = %message, "workflow step failed for good: ending the run with a defect");
            let defect = RawJson::encode(&message).unwrap_or_else(|_| RawJson::null());
            return self.raise(defect_cause(defect));
        }
        tracing::warn!(execution_id = %self.execution_id, error = %message, "workflow run stopped by an engine failure");
        self.update(|state| {
            state.broken.get_or_insert(message);
        });
        std::future::pending()
    }

    /// Clears what stopped an activity's run (a raised cause, an engine failure), so that its
    /// body can run again under the interrupt retry policy.
    pub(crate) fn reset_for_retry(&self) {
        self.update(|state| {
            state.raised = None;
            state.broken = None;
            state.finished = false;
        });
    }

    /// A completion the run awaits arrived: stop at once, report `Suspended`, replay.
    pub(crate) fn preempt(&self) {
        self.update(|state| {
            state.suspended = true;
            state.preempted = true;
        });
    }

    /// Whether a live wait for `name` exists.
    pub(crate) fn awaits(&self, name: &str) -> bool {
        self.awaited.contains(name)
    }

    /// Registers a live wait for `name` (released when an enclosing race settles).
    pub(crate) fn register_await(&self, name: &str) {
        *self.awaited.lock().entry(name.to_owned()).or_default() += 1;
        note_branch_await(name);
    }

    pub(crate) fn release_awaits(&self, names: &[String]) {
        let mut awaited = self.awaited.lock();
        for name in names {
            if let Some(count) = awaited.get_mut(name) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    awaited.remove(name);
                }
            }
        }
    }

    /// Counts a step in flight until the guard drops.
    pub(crate) fn hold(self: &Arc<Run>) -> InFlight {
        self.update(|state| state.in_flight += 1);
        InFlight { run: Arc::clone(self), released: false }
    }

    fn stop_ready(&self) -> bool {
        let state = self.state();
        state.raised.is_some()
            || state.broken.is_some()
            || state.preempted
            || (state.suspended && state.in_flight == 0)
    }

    /// Resolves once the run must stop.
    async fn stopped(&self) {
        loop {
            let changed = self.changed.notified();
            if self.stop_ready() {
                return;
            }
            changed.await;
        }
    }
}

/// A step in flight; dropping it (or [`InFlight::release`]) ends the count.
pub(crate) struct InFlight {
    run: Arc<Run>,
    released: bool,
}

impl InFlight {
    pub(crate) fn release(mut self) {
        self.end();
    }

    fn end(&mut self) {
        if !self.released {
            self.released = true;
            self.run.update(|state| state.in_flight = state.in_flight.saturating_sub(1));
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.end();
    }
}

/// How the driver finished with a body.
#[derive(Debug)]
pub(crate) enum BodyEnd {
    /// The body returned (or panicked: a `Die` exit).
    Returned(Exit),
    /// The body was stopped (suspension, preemption or a raised failure) and dropped.
    Stopped,
}

/// Polls `body` until it returns or `run` must stop; the body is dropped before this returns.
pub(crate) async fn drive(run: &Run, body: impl Future<Output = Exit>) -> BodyEnd {
    let mut body = Box::pin(AssertUnwindSafe(body).catch_unwind());
    let end = tokio::select! {
        biased;
        exit = &mut body => BodyEnd::Returned(exit.unwrap_or_else(|panic| panic_exit(&*panic))),
        () = run.stopped() => BodyEnd::Stopped,
    };
    // Dropping a stopped body runs its locals' `Drop` (the body finalizers), which are user
    // code too: a panic there must not unwind through the run's handler.
    if std::panic::catch_unwind(AssertUnwindSafe(move || drop(body))).is_err() {
        tracing::warn!(execution_id = %run.execution_id, "a body finalizer panicked");
    }
    run.update(|state| state.finished = true);
    end
}

/// The `Die` exit of a panic, with its message.
pub(crate) fn panic_exit(panic: &(dyn std::any::Any + Send)) -> Exit {
    let message = panic
        .downcast_ref::<&str>()
        .map(|message| (*message).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned());
    Exit::die_with_message("Panic", &message)
}

/// A cause with one defect.
pub(crate) fn defect_cause(defect: RawJson) -> Cause {
    Cause(vec![CauseReason::Die(defect)])
}

// Race branches. A race polls each branch with the branch's record set here, so that a step
// that would suspend the run inside a branch only parks that branch, and the waits a branch
// registers are released when the race settles. Thread-local, because a branch is a future
// the user built with the ordinary context: only during its poll do we know it is a branch.

/// What a race knows about one of its branches.
#[derive(Default)]
pub(crate) struct Branch {
    pub(crate) parked: bool,
    pub(crate) awaits: Vec<String>,
}

thread_local! {
    static BRANCH: RefCell<Option<Arc<Mutex<Branch>>>> = const { RefCell::new(None) };
}

/// Runs `poll` with `branch` as the current branch (restoring the enclosing one after).
pub(crate) fn in_branch<T>(branch: &Arc<Mutex<Branch>>, poll: impl FnOnce() -> T) -> T {
    let outer = BRANCH.with(|current| current.replace(Some(Arc::clone(branch))));
    let out = poll();
    BRANCH.with(|current| *current.borrow_mut() = outer);
    out
}

fn park_current_branch() -> bool {
    BRANCH.with(|current| match &*current.borrow() {
        Some(branch) => {
            lock(branch).parked = true;
            true
        }
        None => false,
    })
}

pub(crate) fn note_branch_await(name: &str) {
    BRANCH.with(|current| {
        if let Some(branch) = &*current.borrow() {
            lock(branch).awaits.push(name.to_owned());
        }
    });
}
