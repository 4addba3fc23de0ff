//! The simulation's workflow scenario (feature `workflow`): every runner runs the cluster
//! workflow engine, and the client-only process executes orders, each a saga of two
//! compensated activities, a durable sleep on the cluster's clock and a last activity that
//! fails for some orders.
//!
//! With `exactly_once`, an order ships through a child workflow, `SimShipment`, which packs
//! (undone on failure) and then dispatches, failing for the orders that fail: the child's
//! failure fails the parent.
//!
//! With `holds`, the client also interrupts executions that wait (`SimHold`, suspended on a
//! deferred nobody completes) or that failed under `suspend_on_failure` (`SimHoldSof`): it
//! completes deferreds they do not await (automatic wakes), sometimes resumes them, then
//! interrupts them (safely or not, sometimes twice), while reply writes may be slow. Each must
//! end interrupted (the `suspend_on_failure` one with its original failure) within the bound,
//! never stay suspended, and undo its step once per stored outcome.
//!
//! Checked as the run goes: an activity attempt whose result was stored never runs again (its
//! stored result is what a replay gets). Checked at the end: every order ends within the
//! bound with the outcome its payload asks for; an order that succeeded never compensated; in
//! a failed order, the run whose outcome was stored (its number travels in the error) undid
//! both steps exactly once, in reverse order, and so did the child's (pack). Compensations run
//! once per stored outcome: an earlier run may have compensated too only if its outcome was
//! never stored because its runner crashed, froze or lost track of its locks; a runner that
//! stopped gracefully stores its runs' outcomes (or runs no compensation) first.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cluster_core::Snowflake;
use cluster_core::envelope::{CauseReason, Exit, Reply};
use cluster_core::sync::lock;
use cluster_sharding::Sharding;
use cluster_workflow::{
    ActivityContext, DurableDeferred, ExecuteError, Never, RetrySchedule, Workflow,
    WorkflowContext, WorkflowEngine, WorkflowOptions, WorkflowResult,
};
use serde::{Deserialize, Serialize};

use super::{History, SimRng, StorageEvent, WORKLOAD, millis};

/// One order of the scenario.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Order {
    id: u64,
    /// Whether its last step fails (then the first two are undone).
    fails: bool,
}

/// Why an order failed, and which run decided it (and which run of its shipment, when it
/// shipped through the child workflow).
#[derive(Debug, Serialize, Deserialize)]
struct OrderFailed {
    reason: String,
    run: u64,
    #[serde(default)]
    child_run: Option<u64>,
}

/// The simulated saga.
struct SimOrder;

impl Workflow for SimOrder {
    const NAME: &'static str = "SimOrder";
    type Payload = Order;
    /// The run that completed the order.
    type Success = u64;
    type Error = OrderFailed;

    fn idempotency_key(order: &Order) -> String {
        format!("order-{}", order.id)
    }

    fn options() -> WorkflowOptions {
        WorkflowOptions {
            suspended_retry: RetrySchedule {
                initial: Duration::from_millis(200),
                factor: 1.5,
                max: Duration::from_secs(2),
                attempts: None,
            },
            ..WorkflowOptions::default()
        }
    }
}

/// The shipment of an order, a child workflow (`exactly_once`).
struct SimShipment;

impl Workflow for SimShipment {
    const NAME: &'static str = "SimShipment";
    type Payload = Order;
    /// The run that shipped.
    type Success = u64;
    type Error = OrderFailed;

    fn idempotency_key(order: &Order) -> String {
        format!("shipment-{}", order.id)
    }

    fn options() -> WorkflowOptions {
        SimOrder::options()
    }
}

/// An execution the client interrupts.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Hold {
    id: u64,
}

/// Waits for a deferred nobody completes, after a compensated step: it ends only by an
/// interrupt.
struct SimHold;

impl Workflow for SimHold {
    const NAME: &'static str = "SimHold";
    type Payload = Hold;
    type Success = u64;
    type Error = String;

    fn idempotency_key(hold: &Hold) -> String {
        format!("hold-{}", hold.id)
    }

    fn options() -> WorkflowOptions {
        SimOrder::options()
    }
}

/// Fails after a compensated step under `suspend_on_failure`: it stays suspended (failed) until
/// an interrupt completes it with its failure.
struct SimHoldSof;

impl Workflow for SimHoldSof {
    const NAME: &'static str = "SimHoldSof";
    type Payload = Hold;
    type Success = u64;
    type Error = String;

    fn idempotency_key(hold: &Hold) -> String {
        format!("hold-{}", hold.id)
    }

    fn options() -> WorkflowOptions {
        WorkflowOptions { suspend_on_failure: true, ..SimOrder::options() }
    }
}

/// What the activity requests of the scenario look like (the engine's `activity` payload).
#[derive(Deserialize)]
struct ActivityPayload {
    name: String,
    attempt: u32,
}

/// What the scenario saw, shared by every process of the simulation.
pub(super) struct Ledger {
    history: History,
    violations: Arc<Mutex<Vec<String>>>,
    /// Orders ship through the child workflow.
    children: bool,
    /// The client interrupts executions (`SimHold`, `SimHoldSof`).
    holds: bool,
    state: Mutex<LedgerState>,
}

#[derive(Default)]
struct LedgerState {
    /// Numbers the runs of every order.
    next_run: u64,
    /// The stored activity requests: request id → (execution id, `name/attempt`).
    activity_requests: BTreeMap<Snowflake, (String, String)>,
    /// The activity attempts whose result was stored.
    completed: BTreeSet<(String, String)>,
    /// How often each activity attempt's body ran.
    activity_runs: BTreeMap<(String, String), u32>,
    /// Each order's compensations: (run, step).
    compensations: BTreeMap<u64, Vec<(u64, &'static str)>>,
    /// The runner of each run.
    runners: BTreeMap<u64, Arc<str>>,
    /// The failed orders: the runs whose outcomes were stored (the order's, its shipment's).
    failed: BTreeMap<u64, (u64, Option<u64>)>,
    /// Each hold's compensating runs.
    hold_compensations: BTreeMap<u64, Vec<u64>>,
    /// The holds that completed (approved after safe interrupts only).
    completed_holds: BTreeSet<u64>,
}

impl Ledger {
    pub(super) fn new(
        history: History,
        violations: Arc<Mutex<Vec<String>>>,
        children: bool,
        holds: bool,
    ) -> Arc<Ledger> {
        Arc::new(Ledger { history, violations, children, holds, state: Mutex::default() })
    }

    fn state(&self) -> MutexGuard<'_, LedgerState> {
        lock(&self.state)
    }

    fn violation(&self, what: String) {
        self.history.record(format!("VIOLATION {what}"));
        lock(&self.violations).push(what);
    }

    /// Follows a process's storage: which activity attempts have a stored result.
    pub(super) fn observe(&self, event: &StorageEvent<'_>) {
        match event {
            StorageEvent::RequestSaved(request)
                if request.tag.as_ref() == "activity"
                    && matches!(
                        request.address.entity_type.as_str(),
                        "Workflow/SimOrder"
                            | "Workflow/SimShipment"
                            | "Workflow/SimHold"
                            | "Workflow/SimHoldSof"
                    ) =>
            {
                let Ok(payload) = request.payload.decode::<ActivityPayload>() else { return };
                let key = format!("{}/{}", payload.name, payload.attempt);
                let execution = request.address.entity_id.as_str().to_owned();
                self.state().activity_requests.insert(request.request_id, (execution, key));
            }
            StorageEvent::FinalReplyStored(Reply::WithExit(with_exit)) => {
                let mut state = self.state();
                let Some(attempt) = state.activity_requests.get(&with_exit.request_id).cloned()
                else {
                    return;
                };
                // An activity whose caller went away stores `Suspended`: it runs again.
                let completed = match &with_exit.exit {
                    Exit::Success(json) => WorkflowResult::from_json(json.json_or_null())
                        .is_ok_and(|result| !result.is_suspended()),
                    Exit::Failure(_) => true,
                };
                if completed {
                    state.completed.insert(attempt);
                }
            }
            _ => {}
        }
    }

    /// An activity attempt's body starts: it must not have a stored result.
    fn activity_started(&self, order: u64, context: &ActivityContext, name: &str) {
        let attempt = (context.execution_id().to_string(), format!("{name}/{}", context.attempt()));
        self.history.record(format!("order {order} activity {} runs", attempt.1));
        let again = {
            let mut state = self.state();
            *state.activity_runs.entry(attempt.clone()).or_default() += 1;
            state.completed.contains(&attempt)
        };
        if again {
            self.violation(format!(
                "activity {} of execution {} ran again after its result was stored",
                attempt.1, attempt.0
            ));
        }
    }

    fn compensated(&self, order: u64, run: u64, step: &'static str) {
        self.history.record(format!("order {order} run {run} undoes {step}"));
        self.state().compensations.entry(order).or_default().push((run, step));
    }

    fn next_run(&self, runner: &Arc<str>) -> u64 {
        let mut state = self.state();
        state.next_run += 1;
        let run = state.next_run;
        state.runners.insert(run, Arc::clone(runner));
        run
    }

    /// Registers the scenario's workflow on a runner.
    pub(super) fn register(
        self: &Arc<Ledger>,
        sharding: &Sharding,
        runner: &str,
    ) -> Result<(), String> {
        let engine = WorkflowEngine::cluster(sharding).map_err(|error| error.to_string())?;
        let (ledger, runner) = (Arc::clone(self), Arc::<str>::from(runner));
        if self.children {
            let (ledger, runner) = (Arc::clone(&ledger), Arc::clone(&runner));
            SimShipment::register(&engine, move |ctx, order| {
                shipment(ctx, order, Arc::clone(&ledger), Arc::clone(&runner))
            })
            .map_err(|error| error.to_string())?;
        }
        if self.holds {
            let (held, on) = (Arc::clone(&ledger), Arc::clone(&runner));
            SimHold::register(&engine, move |ctx, hold| {
                held_step(ctx, hold, Arc::clone(&held), Arc::clone(&on), false)
            })
            .map_err(|error| error.to_string())?;
            let (held, on) = (Arc::clone(&ledger), Arc::clone(&runner));
            SimHoldSof::register(&engine, move |ctx, hold| {
                held_step(ctx, hold, Arc::clone(&held), Arc::clone(&on), true)
            })
            .map_err(|error| error.to_string())?;
        }
        SimOrder::register(&engine, move |ctx, order| {
            saga(ctx, order, Arc::clone(&ledger), Arc::clone(&runner))
        })
        .map_err(|error| error.to_string())
    }

    /// Starts `count` holds from the client at times drawn from `rng`, every other one under
    /// `suspend_on_failure`: each is woken, resumed and interrupted as `rng` says, and must end
    /// interrupted.
    pub(super) fn start_holds(
        self: &Arc<Ledger>,
        client: &Sharding,
        count: usize,
        rng: &mut SimRng,
    ) -> Vec<(String, tokio::task::JoinHandle<()>)> {
        let engine = match WorkflowEngine::cluster(client) {
            Ok(engine) => engine,
            Err(error) => {
                self.violation(format!("the client has no workflow engine: {error}"));
                return Vec::new();
            }
        };
        (0..count)
            .map(|index| {
                let id = u64::try_from(index).unwrap_or(u64::MAX);
                let plan = HoldPlan::draw(rng);
                let (engine, ledger) = (engine.clone(), Arc::clone(self));
                let call = tokio::spawn(async move {
                    if index % 2 == 0 {
                        ledger.hold::<SimHold>(&engine, id, plan).await;
                    } else {
                        ledger.hold::<SimHoldSof>(&engine, id, plan).await;
                    }
                });
                (format!("hold {id}"), call)
            })
            .collect()
    }

    /// Runs hold `id` of workflow `W` through `plan`, then checks how it ended.
    async fn hold<W>(&self, engine: &WorkflowEngine, id: u64, plan: HoldPlan)
    where
        W: Workflow<Payload = Hold, Success = u64, Error = String>,
    {
        let hold = Hold { id };
        let execution = W::execution_id(&hold);
        tokio::time::sleep(plan.start).await;
        self.retrying(id, "start", || engine.execute_discard::<W>(hold.clone())).await;
        tokio::time::sleep(plan.first_wake).await;
        for (index, pause) in plan.wakes.iter().enumerate() {
            let token = DurableDeferred::<(), Never>::new(format!("noise-{index}"))
                .map(|deferred| deferred.token_for::<W>(&execution));
            match token {
                Ok(token) => {
                    self.retrying(id, "wake", || engine.complete(&token, Ok::<(), Never>(())))
                        .await;
                }
                Err(error) => self.violation(format!("hold {id}: {error}")),
            }
            tokio::time::sleep(*pause).await;
        }
        if plan.resume {
            self.retrying(id, "resume", || engine.resume::<W>(&execution)).await;
        }
        for unsafe_interrupt in &plan.interrupts {
            self.history.record(format!("hold {id} interrupted (unsafe: {unsafe_interrupt})"));
            if *unsafe_interrupt {
                self.retrying(id, "interrupt", || engine.interrupt_unsafe::<W>(&execution)).await;
            } else {
                self.retrying(id, "interrupt", || engine.interrupt::<W>(&execution)).await;
            }
            tokio::time::sleep(plan.between_interrupts).await;
        }
        if plan.approve {
            // The awaited completion lands right after the interrupts: a safe interrupt may
            // lose to it (the run completes without another step), an unsafe one may not.
            let token = DurableDeferred::<u64, String>::new("approval")
                .map(|deferred| deferred.token_for::<W>(&execution));
            if let Ok(token) = token {
                self.retrying(id, "approve", || engine.complete(&token, Ok::<u64, String>(id)))
                    .await;
            }
        }
        // Ends, or the caller's bound reports it.
        let exit = loop {
            match engine.poll::<W>(&execution).await {
                Ok(Some(WorkflowResult::Complete(exit))) => break exit,
                Ok(_) => {}
                Err(error) => self.history.record(format!("hold {id} poll: {error}")),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let reserved =
            self.state().completed.contains(&(execution.to_string(), "reserve/1".to_owned()));
        let safe_only = !plan.interrupts.iter().any(|unsafe_interrupt| *unsafe_interrupt);
        let may_complete = plan.approve && safe_only && !W::options().suspend_on_failure;
        self.check_hold(id, W::options().suspend_on_failure, reserved, may_complete, &exit);
    }

    /// Calls `call` until it succeeds (an engine failure is retried).
    async fn retrying<T, F, Fut>(&self, id: u64, what: &str, mut call: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, cluster_workflow::WorkflowError>>,
    {
        while let Err(error) = call().await {
            self.history.record(format!("retry hold {id} {what}: {error}"));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// A hold ended with `exit`. It is interrupted, unless its step's result was stored
    /// (`reserved`) under `suspend_on_failure`: every run then fails, and the interrupt completes
    /// it with its original failure. A stored step is undone; a step that never ran (the
    /// interrupt came first, and a pending interrupt starts no step) is not.
    /// A hold approved after safe interrupts only (`may_complete`) may complete instead: a safe
    /// interrupt that meets no further step is lost, as in the reference.
    fn check_hold(
        &self,
        id: u64,
        suspend_on_failure: bool,
        reserved: bool,
        may_complete: bool,
        exit: &Exit,
    ) {
        let compensations = self.state().hold_compensations.get(&id).cloned().unwrap_or_default();
        self.history.record(format!(
            "hold {id} ended with {exit:?}, reserved: {reserved}, undone by runs {compensations:?}"
        ));
        let expected = match exit {
            Exit::Failure(cause) if suspend_on_failure && reserved => {
                cause.0.iter().any(|reason| matches!(reason, CauseReason::Fail(_)))
                    && !cause.has_interrupts()
            }
            Exit::Failure(cause) => cause.has_interrupts_only(),
            Exit::Success(_) => may_complete,
        };
        if !expected {
            self.violation(format!(
                "hold {id} (suspend_on_failure: {suspend_on_failure}, reserved: {reserved}) ended with {exit:?}"
            ));
        }
        // A completed hold is checked at the end: only runs whose outcomes were not stored
        // may have undone its step.
        if matches!(exit, Exit::Success(_)) {
            self.state().completed_holds.insert(id);
        } else if reserved == compensations.is_empty() {
            self.violation(format!(
                "hold {id}: its step was {}stored, it ended with {exit:?}, and it was undone by runs {compensations:?}",
                if reserved { "" } else { "not " }
            ));
        }
    }

    /// Executes `count` orders from the client at times drawn from `rng` (every fourth one
    /// fails); each caller retries an engine failure until its order ends.
    pub(super) fn start(
        self: &Arc<Ledger>,
        client: &Sharding,
        count: usize,
        rng: &mut SimRng,
    ) -> Vec<(String, tokio::task::JoinHandle<()>)> {
        let engine = match WorkflowEngine::cluster(client) {
            Ok(engine) => engine,
            Err(error) => {
                self.violation(format!("the client has no workflow engine: {error}"));
                return Vec::new();
            }
        };
        let mut calls = Vec::with_capacity(count);
        for index in 0..count {
            let id = u64::try_from(index).unwrap_or(u64::MAX);
            let order = Order { id, fails: index % 4 == 3 };
            let at = rng.duration(Duration::ZERO, WORKLOAD);
            let (engine, ledger) = (engine.clone(), Arc::clone(self));
            let call = tokio::spawn(async move {
                tokio::time::sleep(at).await;
                loop {
                    match engine.execute::<SimOrder>(order.clone()).await {
                        Err(ExecuteError::Engine(error)) => {
                            ledger.history.record(format!("retry order {id}: {error}"));
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        outcome => return ledger.check_outcome(&order, outcome),
                    }
                }
            });
            calls.push((format!("order {id}"), call));
        }
        calls
    }

    /// An order ended: its outcome and its compensations.
    fn check_outcome(&self, order: &Order, outcome: Result<u64, ExecuteError<OrderFailed>>) {
        let id = order.id;
        let compensations = self.state().compensations.get(&id).cloned().unwrap_or_default();
        match (order.fails, outcome) {
            (false, Ok(run)) => {
                self.history.record(format!("order {id} done by run {run}"));
                if !compensations.is_empty() {
                    self.violation(format!(
                        "order {id} succeeded but compensated {compensations:?}"
                    ));
                }
            }
            (true, Err(ExecuteError::Failed(failed))) if failed.reason == "no courier" => {
                let (run, child_run) = (failed.run, failed.child_run);
                let steps = |of: u64| -> Vec<&str> {
                    compensations
                        .iter()
                        .filter(|(by, _)| *by == of)
                        .map(|(_, step)| *step)
                        .collect()
                };
                let others = compensations
                    .iter()
                    .filter(|(by, _)| *by != run && Some(*by) != child_run)
                    .count();
                self.history.record(format!(
                    "order {id} failed in run {run} (shipment run {child_run:?}), undone {:?}, {others} by earlier runs",
                    steps(run)
                ));
                if steps(run) != ["charge", "reserve"] {
                    self.violation(format!(
                        "order {id}: the run that failed it undid {:?}, not charge then reserve once",
                        steps(run)
                    ));
                }
                if let Some(child_run) = child_run
                    && steps(child_run) != ["pack"]
                {
                    self.violation(format!(
                        "order {id}: the shipment run that failed it undid {:?}, not pack once",
                        steps(child_run)
                    ));
                }
                self.state().failed.insert(id, (run, child_run));
            }
            (_, outcome) => {
                self.violation(format!(
                    "order {id} (fails: {}) ended with {outcome:?}",
                    order.fails
                ));
            }
        }
    }

    /// At the end: every activity attempt with a stored result ran at least once, and in each
    /// failed order a run whose outcome was not stored compensated only if its runner crashed,
    /// froze or lost track of its locks (`ungraceful`).
    pub(super) fn check_end(
        &self,
        ungraceful: &BTreeMap<String, &'static str>,
        failed_entities: &BTreeSet<String>,
    ) {
        let repeated: Vec<String> = {
            let state = self.state();
            state
                .failed
                .iter()
                .flat_map(|(order, (run, child_run))| {
                    let compensations = state.compensations.get(order).cloned().unwrap_or_default();
                    let state = &state;
                    compensations.into_iter().filter_map(move |(by, step)| {
                        let runner = state.runners.get(&by).map_or("?", |runner| &**runner);
                        let decisive = by == *run || Some(by) == *child_run;
                        // A run whose outcome's write failed (storage errors) is not stored.
                        let order = Order { id: *order, fails: true };
                        let failed_write = [
                            SimOrder::execution_id(&order).to_string(),
                            SimShipment::execution_id(&order).to_string(),
                        ]
                        .iter()
                        .any(|execution| failed_entities.contains(execution));
                        let excused = ungraceful.contains_key(runner) || failed_write;
                        (!decisive && !excused).then(|| {
                            format!(
                                "order {}: run {by} on {runner} undid {step}, but its outcome was not stored and {runner} neither crashed nor froze", order.id
                            )
                        })
                    })
                })
                .collect()
        };
        for what in repeated {
            self.violation(what);
        }
        let state = self.state();
        for attempt in &state.completed {
            if !state.activity_runs.contains_key(attempt) {
                let what = format!(
                    "activity {} of execution {} stored but never ran",
                    attempt.1, attempt.0
                );
                drop(state);
                self.violation(what);
                return;
            }
        }
        // Each hold's step is undone once per stored failed outcome: every compensating run but
        // the decisive one (none for a completed hold) ran on a runner that crashed or froze, or
        // wrote to a failing storage.
        for (hold, runs) in &state.hold_compensations {
            let decisive = usize::from(!state.completed_holds.contains(hold));
            let unexcused: Vec<&u64> = runs
                .iter()
                .filter(|run| {
                    let runner = state.runners.get(run).map_or("?", |runner| &**runner);
                    let failed_write = [
                        SimHold::execution_id(&Hold { id: *hold }).to_string(),
                        SimHoldSof::execution_id(&Hold { id: *hold }).to_string(),
                    ]
                    .iter()
                    .any(|execution| failed_entities.contains(execution));
                    !ungraceful.contains_key(runner) && !failed_write
                })
                .collect();
            if unexcused.len() > decisive {
                let what = format!(
                    "hold {hold}: runs {unexcused:?} undid its step (the decisive ones: {decisive}), and their runners neither crashed nor froze"
                );
                drop(state);
                self.violation(what);
                return;
            }
        }
        let runs: u32 = state.activity_runs.values().sum();
        let attempts = state.activity_runs.len();
        drop(state);
        self.history.record(format!(
            "workflows: {attempts} activity attempts, {runs} activity runs, {}ms",
            millis(self.history.start.elapsed())
        ));
    }
}

/// What the storage holds for order `id`'s execution (for the trace of a failed run).
pub(super) fn describe(storage: &crate::memory::MemoryMessageStorage, id: u64) -> Vec<String> {
    let execution = SimOrder::execution_id(&Order { id, fails: false });
    storage.describe(execution.as_str())
}

/// The saga: reserve and charge (each undone on failure), a durable sleep, then ship.
async fn saga(
    ctx: WorkflowContext,
    order: Order,
    ledger: Arc<Ledger>,
    runner: Arc<str>,
) -> Result<u64, OrderFailed> {
    let run = ledger.next_run(&runner);
    let id = order.id;
    ledger.history.record(format!("order {id} run {run} on {runner}"));
    for step in ["reserve", "charge"] {
        let undo = Arc::clone(&ledger);
        ctx.activity(step, async |context| {
            ledger.activity_started(id, &context, step);
            Ok::<u64, String>(id)
        })
        .compensate(move |_, _| async move { undo.compensated(id, run, step) })
        .await
        .map_err(|reason| OrderFailed { reason, run, child_run: None })?;
    }
    // The cluster's durable clock, not an in-memory sleep.
    ledger.history.record(format!("order {id} run {run} sleeps"));
    ctx.sleep_with_threshold("pause", Duration::from_millis(300), Duration::ZERO).await;
    ledger.history.record(format!("order {id} run {run} woke"));
    if ledger.children {
        ctx.child::<SimShipment>(order).await.map_err(|failed| OrderFailed {
            reason: failed.reason,
            run,
            child_run: Some(failed.run),
        })?;
        return Ok(run);
    }
    ctx.activity("ship", async |context| {
        ledger.activity_started(id, &context, "ship");
        if order.fails { Err("no courier".to_owned()) } else { Ok(()) }
    })
    .await
    .map_err(|reason| OrderFailed { reason, run, child_run: None })?;
    Ok(run)
}

/// The shipment, a child of the order: pack (undone on failure), then dispatch.
async fn shipment(
    ctx: WorkflowContext,
    order: Order,
    ledger: Arc<Ledger>,
    runner: Arc<str>,
) -> Result<u64, OrderFailed> {
    let run = ledger.next_run(&runner);
    let id = order.id;
    ledger.history.record(format!("order {id} shipment run {run} on {runner}"));
    let undo = Arc::clone(&ledger);
    ctx.activity("pack", async |context| {
        ledger.activity_started(id, &context, "pack");
        Ok::<u64, String>(id)
    })
    .compensate(move |_, _| async move { undo.compensated(id, run, "pack") })
    .await
    .map_err(|reason| OrderFailed { reason, run, child_run: None })?;
    ctx.activity("dispatch", async |context| {
        ledger.activity_started(id, &context, "dispatch");
        if order.fails { Err("no courier".to_owned()) } else { Ok(()) }
    })
    .await
    .map_err(|reason| OrderFailed { reason, run, child_run: None })?;
    Ok(run)
}

/// When and how the client wakes, resumes and interrupts one hold.
struct HoldPlan {
    start: Duration,
    first_wake: Duration,
    /// The pause after each automatic wake.
    wakes: Vec<Duration>,
    resume: bool,
    /// Each interrupt, unsafe or not.
    interrupts: Vec<bool>,
    between_interrupts: Duration,
    /// The awaited completion comes after the interrupts.
    approve: bool,
}

impl HoldPlan {
    /// A plan drawn from `rng`: the wakes and the interrupt come close together, so that they
    /// often meet a run's slow reply write.
    fn draw(rng: &mut SimRng) -> HoldPlan {
        let start = rng.duration(Duration::ZERO, WORKLOAD / 2);
        let first_wake = rng.duration(Duration::ZERO, Duration::from_millis(600));
        let wakes = (0..1 + rng.below(3))
            .map(|_| rng.duration(Duration::ZERO, Duration::from_millis(150)))
            .collect();
        let resume = rng.below(4) == 0;
        let interrupts = (0..1 + rng.below(2)).map(|_| rng.below(2) == 0).collect();
        let between_interrupts = rng.duration(Duration::ZERO, Duration::from_millis(400));
        let approve = rng.below(2) == 0;
        HoldPlan { start, first_wake, wakes, resume, interrupts, between_interrupts, approve }
    }
}

/// A hold's body: reserve (undone on failure), then wait for a deferred nobody completes, or,
/// under `suspend_on_failure`, fail.
async fn held_step(
    ctx: WorkflowContext,
    hold: Hold,
    ledger: Arc<Ledger>,
    runner: Arc<str>,
    fails: bool,
) -> Result<u64, String> {
    let run = ledger.next_run(&runner);
    let id = hold.id;
    ledger.history.record(format!("hold {id} run {run} on {runner}"));
    let undo = Arc::clone(&ledger);
    ctx.activity("reserve", async |context| {
        ledger.activity_started(id, &context, "reserve");
        Ok::<u64, String>(id)
    })
    .compensate(move |_, _| async move {
        undo.history.record(format!("hold {id} run {run} undoes reserve"));
        undo.state().hold_compensations.entry(id).or_default().push(run);
    })
    .await?;
    if fails {
        return Err("refused".to_owned());
    }
    let approval =
        DurableDeferred::<u64, String>::new("approval").map_err(|error| error.to_string())?;
    ctx.await_deferred(&approval).await
}
