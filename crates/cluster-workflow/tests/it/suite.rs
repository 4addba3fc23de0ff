//! The engine-independent test suite. Each function takes a [`Harness`] that makes a fresh
//! engine; durations are virtual under the in-memory harness (tokio's paused clock).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::envelope::{CauseReason, Exit, RawJson};
use cluster_core::sync::lock;
use cluster_testkit::wait::eventually;
use cluster_workflow::{
    ActivityError, DurableDeferred, ExecuteError, ExecutionId, FailureCause, InterruptRetry, Never,
    RunExit, Workflow, WorkflowContext, WorkflowEngine, WorkflowError, WorkflowOptions,
    WorkflowResult,
};
use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

/// Makes the engine a test runs on.
pub(crate) trait Harness {
    /// A fresh engine with nothing registered.
    async fn engine(&self) -> WorkflowEngine;

    /// Whether the engine is the cluster one (where the reference's engines differ).
    fn is_cluster(&self) -> bool {
        false
    }

    /// The most bytes the engine's storage keeps in one value, if it has such a limit.
    fn value_bytes_max(&self) -> Option<usize> {
        None
    }
}

thread_local! {
    /// The suite's durations are divided by this: 1 on a paused clock, more on a real one.
    static TIME_DIVISOR: std::cell::Cell<u32> = const { std::cell::Cell::new(1) };
}

/// Divides every duration of the suite (for harnesses on a real clock).
pub(crate) fn set_time_divisor(divisor: u32) {
    TIME_DIVISOR.with(|cell| cell.set(divisor.max(1)));
}

/// `millis` of the suite's time.
fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis) / TIME_DIVISOR.with(std::cell::Cell::get)
}

/// The payload of every test workflow.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Input {
    pub(crate) key: String,
    pub(crate) value: u64,
    pub(crate) to: String,
}

fn input(key: &str) -> Input {
    Input { key: key.to_owned(), ..Input::default() }
}

fn input_to(key: &str, to: &str) -> Input {
    Input { key: key.to_owned(), to: to.to_owned(), ..Input::default() }
}

macro_rules! workflow {
    ($name:ident, $success:ty, $error:ty) => {
        workflow!($name, $success, $error, WorkflowOptions::default());
    };
    ($name:ident, $success:ty, $error:ty, $options:expr) => {
        struct $name;
        impl Workflow for $name {
            const NAME: &'static str = stringify!($name);
            type Payload = Input;
            type Success = $success;
            type Error = $error;
            fn idempotency_key(payload: &Input) -> String {
                payload.key.clone()
            }
            fn options() -> WorkflowOptions {
                $options
            }
        }
    };
}

/// An ordered record of what happened.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, entry: impl Into<String>) {
        lock(&self.0).push(entry.into());
    }

    fn entries(&self) -> Vec<String> {
        lock(&self.0).clone()
    }

    fn count(&self, entry: &str) -> usize {
        self.entries().iter().filter(|e| e.as_str() == entry).count()
    }

    fn contains(&self, entry: &str) -> bool {
        self.count(entry) > 0
    }
}

/// Logs `entry` when dropped: a body finalizer.
struct OnDrop(Log, String);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.push(self.1.clone());
    }
}

/// Polls until the execution's latest result satisfies `accept`.
async fn poll_until<W: Workflow>(
    engine: &WorkflowEngine,
    id: &ExecutionId,
    what: &str,
    accept: impl Fn(&WorkflowResult) -> bool,
) -> WorkflowResult {
    for _ in 0..30_000 {
        if let Some(result) = engine.poll::<W>(id).await.expect("poll")
            && accept(&result)
        {
            return result;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

pub(crate) async fn complete_exit<W: Workflow>(engine: &WorkflowEngine, id: &ExecutionId) -> Exit {
    match poll_until::<W>(engine, id, "the execution completes", |r| !r.is_suspended()).await {
        WorkflowResult::Complete(exit) => exit,
        WorkflowResult::Suspended { .. } => unreachable!(),
    }
}

pub(crate) async fn suspended<W: Workflow>(
    engine: &WorkflowEngine,
    id: &ExecutionId,
) -> WorkflowResult {
    poll_until::<W>(engine, id, "the execution suspends", WorkflowResult::is_suspended).await
}

fn success<T: Serialize>(value: T) -> Exit {
    Exit::Success(RawJson::encode(&value).unwrap())
}

/// `success`, `fail`, `die` or `interrupt`: the kind of an exit.
fn kind(exit: &Exit) -> &'static str {
    match exit {
        Exit::Success(_) => "success",
        Exit::Failure(cause) if cause.0.iter().any(|r| matches!(r, CauseReason::Fail(_))) => "fail",
        Exit::Failure(cause) if cause.0.iter().any(|r| matches!(r, CauseReason::Die(_))) => "die",
        Exit::Failure(_) => "interrupt",
    }
}

fn cause_kind(cause: &FailureCause) -> &'static str {
    kind(&Exit::Failure(cause.0.clone()))
}

fn gate() -> DurableDeferred<String> {
    DurableDeferred::new("Gate").unwrap()
}

async fn open<W: Workflow>(
    engine: &WorkflowEngine,
    id: &ExecutionId,
    deferred: &DurableDeferred<String>,
    value: &str,
) {
    let token = deferred.token_for::<W>(id);
    engine.complete(&token, Ok::<String, Never>(value.to_owned())).await.expect("complete");
}

// ---------------------------------------------------------------------------------------
// Executing, polling, attaching (effect's `WorkflowEngine.test.ts`)

workflow!(Doubler, u64, String);

fn register_doubler(engine: &WorkflowEngine, runs: &Log) {
    let runs = runs.clone();
    Doubler::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let runs = runs.clone();
        async move {
            let activity_runs = runs.clone();
            let doubled: u64 = ctx
                .activity("double", move |_| {
                    let runs = activity_runs.clone();
                    async move {
                        runs.push("double");
                        Ok::<_, String>(payload.value * 2)
                    }
                })
                .await?;
            Ok(doubled)
        }
    })
    .unwrap();
}

pub(crate) async fn executes_and_polls(h: &impl Harness) {
    let engine = h.engine().await;
    register_doubler(&engine, &Log::default());
    let discarded =
        engine.execute_discard::<Doubler>(Input { value: 5, ..input("d") }).await.unwrap();
    assert_eq!(complete_exit::<Doubler>(&engine, &discarded).await, success(10));
    let payload = Input { value: 1, ..input("e") };
    let id = Doubler::execution_id(&payload);
    assert_eq!(engine.execute::<Doubler>(payload).await.unwrap(), 2);
    assert_eq!(
        engine.poll::<Doubler>(&id).await.unwrap(),
        Some(WorkflowResult::Complete(success(2)))
    );
    assert_eq!(
        engine.poll::<Doubler>(&ExecutionId::derive("Doubler", "unknown")).await.unwrap(),
        None
    );
}

pub(crate) async fn discard_returns_the_deterministic_execution_id(h: &impl Harness) {
    let engine = h.engine().await;
    register_doubler(&engine, &Log::default());
    let payload = input("deterministic");
    let id = engine.execute_discard::<Doubler>(payload.clone()).await.unwrap();
    assert_eq!(id, Doubler::execution_id(&payload));
    assert_eq!(id, ExecutionId::derive("Doubler", "deterministic"));
}

pub(crate) async fn executing_again_attaches_to_the_execution(h: &impl Harness) {
    workflow!(Gated, u64, Never);
    let engine = h.engine().await;
    let log = Log::default();
    let permits = Arc::new(Semaphore::new(0));
    {
        let (log, permits) = (log.clone(), Arc::clone(&permits));
        Gated::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let (log, permits) = (log.clone(), Arc::clone(&permits));
            async move {
                ctx.activity("gated", move |_| {
                    let (log, permits) = (log.clone(), Arc::clone(&permits));
                    async move {
                        log.push("gated");
                        permits.acquire().await.unwrap().forget();
                        Ok::<u64, Never>(42)
                    }
                })
                .await
            }
        })
        .unwrap();
    }
    let (first, second) = (engine.clone(), engine.clone());
    let first = tokio::spawn(async move { first.execute::<Gated>(input("same")).await.unwrap() });
    let second = tokio::spawn(async move { second.execute::<Gated>(input("same")).await.unwrap() });
    eventually("the activity runs", || log.contains("gated")).await;
    permits.add_permits(1);
    assert_eq!(first.await.unwrap(), 42);
    assert_eq!(second.await.unwrap(), 42);
    assert_eq!(engine.execute::<Gated>(input("same")).await.unwrap(), 42);
    assert_eq!(log.count("gated"), 1, "the activity body ran once");
}

// ---------------------------------------------------------------------------------------
// The in-memory engine's own tests (effect's `WorkflowEngine.test.ts`)

pub(crate) async fn a_completed_deferred_wakes_an_active_run(h: &impl Harness) {
    workflow!(Waker, String, Never);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Waker::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                log.push("run");
                let signal: BoxFuture<'_, Result<String, Never>> = Box::pin(async {
                    ctx.await_deferred(&gate()).await.map(|_| "signal".to_owned())
                });
                let timeout: BoxFuture<'_, Result<String, Never>> = Box::pin(async {
                    tokio::time::sleep(ms(10000)).await;
                    Ok("timeout".to_owned())
                });
                ctx.race("race", vec![signal, timeout]).await
            }
        })
        .unwrap();
    }
    let id = engine.execute_discard::<Waker>(input("w")).await.unwrap();
    eventually("the run started", || log.contains("run")).await;
    open::<Waker>(&engine, &id, &gate(), "go").await;
    assert_eq!(complete_exit::<Waker>(&engine, &id).await, success("signal"));
    assert_eq!(engine.execute::<Waker>(input("w")).await.unwrap(), "signal");
    let runs = log.count("run");
    assert!((1..=2).contains(&runs), "{runs} runs");
}

pub(crate) async fn shutdown_interrupts_waiting_callers(h: &impl Harness) {
    workflow!(Forever, (), Never);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Forever::register(&engine, move |_: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                log.push("run");
                std::future::pending::<()>().await;
                Ok(())
            }
        })
        .unwrap();
    }
    let caller = engine.clone();
    let caller = tokio::spawn(async move { caller.execute::<Forever>(input("f")).await });
    eventually("the run started", || log.contains("run")).await;
    engine.shutdown().await;
    assert!(matches!(caller.await.unwrap(), Err(ExecuteError::Interrupted)));
    assert!(matches!(
        engine.execute_discard::<Forever>(input("g")).await,
        Err(WorkflowError::ShutDown)
    ));
}

// A workflow that records, per run, its workflow finalizer and its body finalizer around an
// await of the gate.
workflow!(Recorder, String, Never);

fn register_recorder(engine: &WorkflowEngine, log: &Log, runs: &Arc<AtomicU32>) {
    let (log, runs) = (log.clone(), Arc::clone(runs));
    Recorder::register(engine, move |ctx: WorkflowContext, _: Input| {
        let (log, runs) = (log.clone(), Arc::clone(&runs));
        async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let finalizer_log = log.clone();
            ctx.add_finalizer(move |exit: RunExit| async move {
                finalizer_log.push(format!("wf:{run}:{}:{}", kind(&exit.exit), exit.interrupted));
            });
            let body = BodyFinalizer { ctx: ctx.clone(), log: log.clone() };
            let value = ctx.await_deferred(&gate()).await?;
            drop(body);
            Ok(value)
        }
    })
    .unwrap();
}

/// Records whether the run is interrupted when the body is dropped or finishes.
struct BodyFinalizer {
    ctx: WorkflowContext,
    log: Log,
}

impl Drop for BodyFinalizer {
    fn drop(&mut self) {
        self.log.push(format!("body:{}:{}", self.ctx.is_suspended(), self.ctx.is_interrupted()));
    }
}

pub(crate) async fn superseded_runs_finalize_after_the_final_run(h: &impl Harness) {
    let engine = h.engine().await;
    let (log, runs) = (Log::default(), Arc::new(AtomicU32::new(0)));
    register_recorder(&engine, &log, &runs);
    let id = engine.execute_discard::<Recorder>(input("r")).await.unwrap();
    suspended::<Recorder>(&engine, &id).await;
    open::<Recorder>(&engine, &id, &gate(), "go").await;
    assert_eq!(complete_exit::<Recorder>(&engine, &id).await, success("go"));
    let finalizers: Vec<String> =
        log.entries().into_iter().filter(|e| e.starts_with("wf:")).collect();
    assert_eq!(finalizers, ["wf:2:success:false", "wf:1:success:false"]);
}

pub(crate) async fn body_finalizers_do_not_see_a_deposited_interrupt(h: &impl Harness) {
    let engine = h.engine().await;
    let (log, runs) = (Log::default(), Arc::new(AtomicU32::new(0)));
    register_recorder(&engine, &log, &runs);
    let id = engine.execute_discard::<Recorder>(input("b")).await.unwrap();
    suspended::<Recorder>(&engine, &id).await;
    engine.interrupt::<Recorder>(&id).await.unwrap();
    let exit = complete_exit::<Recorder>(&engine, &id).await;
    assert_eq!(kind(&exit), "interrupt");
    let bodies: Vec<String> =
        log.entries().into_iter().filter(|e| e.starts_with("body:")).collect();
    // Both runs' bodies were dropped at a suspension, before the interrupt was applied.
    assert_eq!(bodies, ["body:true:false", "body:true:false"]);
}

pub(crate) async fn workflow_finalizers_see_a_deposited_interrupt(h: &impl Harness) {
    let engine = h.engine().await;
    let (log, runs) = (Log::default(), Arc::new(AtomicU32::new(0)));
    register_recorder(&engine, &log, &runs);
    let id = engine.execute_discard::<Recorder>(input("i")).await.unwrap();
    suspended::<Recorder>(&engine, &id).await;
    engine.interrupt::<Recorder>(&id).await.unwrap();
    complete_exit::<Recorder>(&engine, &id).await;
    let finalizers: Vec<String> =
        log.entries().into_iter().filter(|e| e.starts_with("wf:")).collect();
    assert_eq!(finalizers, ["wf:2:interrupt:true", "wf:1:success:false"]);
    let caller = engine.execute::<Recorder>(input("i")).await;
    assert!(matches!(caller, Err(ExecuteError::Interrupted)), "{caller:?}");
}

pub(crate) async fn interrupt_unsafe_applies_across_a_suspended_replay(h: &impl Harness) {
    let engine = h.engine().await;
    let (log, runs) = (Log::default(), Arc::new(AtomicU32::new(0)));
    register_recorder(&engine, &log, &runs);
    let id = engine.execute_discard::<Recorder>(input("u")).await.unwrap();
    suspended::<Recorder>(&engine, &id).await;
    engine.interrupt_unsafe::<Recorder>(&id).await.unwrap();
    open::<Recorder>(&engine, &id, &gate(), "go").await;
    let exit = complete_exit::<Recorder>(&engine, &id).await;
    assert_eq!(kind(&exit), "interrupt", "{exit:?}");
}

// ---------------------------------------------------------------------------------------
// The email workflow (`effect/src/cluster/ClusterWorkflowEngine.ts` and effect's
// `ClusterWorkflowEngine.test.ts`)

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SendEmailError {
    attempt: u32,
}

workflow!(EmailWorkflow, (), SendEmailError);

fn email_trigger() -> DurableDeferred<()> {
    DurableDeferred::new("EmailTrigger").unwrap()
}

fn register_email(engine: &WorkflowEngine, log: &Log) {
    let log = log.clone();
    EmailWorkflow::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let log = log.clone();
        async move {
            log.push("run");
            let _finalizer = OnDrop(log.clone(), "finalizer".into());
            let (send_log, compensation_log) = (log.clone(), log.clone());
            ctx.activity("SendEmail", move |activity| {
                let log = send_log.clone();
                async move {
                    let attempt = activity.attempt();
                    log.push(format!("send:{attempt}"));
                    if attempt == 5 { Ok(()) } else { Err(SendEmailError { attempt }) }
                }
            })
            .retry(5)
            .compensate(move |(), cause| async move {
                compensation_log.push(format!("compensation:{}", cause_kind(&cause)));
            })
            .await?;
            if payload.to == "compensation" {
                return Err(SendEmailError { attempt: 0 });
            }
            ctx.activity("Sleep", |activity| async move {
                activity
                    .context()
                    .sleep_with_threshold("Some sleep", ms(10000), Duration::ZERO)
                    .await;
                Ok::<(), Never>(())
            })
            .await
            .unwrap_or_else(|never| match never {});
            let _ensuring = OnDrop(log.clone(), "ensuring".into());
            ctx.await_deferred(&email_trigger()).await.unwrap_or_else(|never| match never {});
            log.push("triggered");
            Ok(())
        }
    })
    .unwrap();
}

pub(crate) async fn email_workflow_suspends_resumes_and_deduplicates(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_email(&engine, &log);
    let payload = input_to("test-email-1", "someone");
    let id = EmailWorkflow::execution_id(&payload);
    assert_eq!(id.as_str(), "8f86cb6dac9f9bc041a2165d105c1362");
    let caller = engine.clone();
    let caller = tokio::spawn(async move { caller.execute::<EmailWorkflow>(payload).await });
    // The clock fires after 10 s; the replay then suspends on the trigger.
    eventually("the run waits for the trigger", || log.contains("ensuring")).await;
    suspended::<EmailWorkflow>(&engine, &id).await;
    assert!(log.contains("finalizer"), "body finalizer ran at the suspension");
    assert!(!log.entries().iter().any(|e| e.starts_with("compensation")));
    for attempt in 1..=5 {
        assert_eq!(log.count(&format!("send:{attempt}")), 1, "attempt {attempt} ran once");
    }
    let token = email_trigger().token_for::<EmailWorkflow>(&id);
    assert_eq!(
        token.encode(),
        "WyJFbWFpbFdvcmtmbG93IiwiOGY4NmNiNmRhYzlmOWJjMDQxYTIxNjVkMTA1YzEzNjIiLCJFbWFpbFRyaWdnZXIiXQ"
    );
    engine.complete(&token, Ok::<(), Never>(())).await.unwrap();
    caller.await.unwrap().unwrap();
    assert_eq!(log.count("triggered"), 1);
    // A second execute attaches to the completed execution.
    let runs = log.count("run");
    engine.execute::<EmailWorkflow>(input_to("test-email-1", "someone")).await.unwrap();
    assert_eq!(log.count("run"), runs);
    assert_eq!(
        engine.poll::<EmailWorkflow>(&id).await.unwrap(),
        Some(WorkflowResult::Complete(Exit::void()))
    );
    assert!(!log.entries().iter().any(|e| e.starts_with("compensation")));
}

pub(crate) async fn interrupting_a_suspended_execution_runs_its_compensation_once(
    h: &impl Harness,
) {
    let engine = h.engine().await;
    let log = Log::default();
    register_email(&engine, &log);
    let id = engine.execute_discard::<EmailWorkflow>(input_to("interrupted", "x")).await.unwrap();
    eventually("the run waits for the trigger", || log.contains("ensuring")).await;
    suspended::<EmailWorkflow>(&engine, &id).await;
    engine.interrupt::<EmailWorkflow>(&id).await.unwrap();
    let exit = complete_exit::<EmailWorkflow>(&engine, &id).await;
    assert_eq!(kind(&exit), "interrupt");
    assert_eq!(log.count("compensation:interrupt"), 1, "{:?}", log.entries());
    let caller = engine.execute::<EmailWorkflow>(input_to("interrupted", "x")).await;
    assert!(matches!(caller, Err(ExecuteError::Interrupted)), "{caller:?}");
}

pub(crate) async fn compensation_runs_once_when_the_execution_fails(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_email(&engine, &log);
    let result = engine.execute::<EmailWorkflow>(input_to("fails", "compensation")).await;
    assert!(
        matches!(result, Err(ExecuteError::Failed(SendEmailError { attempt: 0 }))),
        "{result:?}"
    );
    assert_eq!(log.count("compensation:fail"), 1, "{:?}", log.entries());
}

// ---------------------------------------------------------------------------------------
// Compensation-aware replay: the scenario matrix of `effect/src/workflow/Workflow.ts`

workflow!(Saga, String, String);

fn register_saga(engine: &WorkflowEngine, log: &Log, long: &Arc<Semaphore>) {
    let (log, long) = (log.clone(), Arc::clone(long));
    let runs = Arc::new(AtomicU32::new(0));
    Saga::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let (log, long, runs) = (log.clone(), Arc::clone(&long), Arc::clone(&runs));
        async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            log.push(format!("run:{run}"));
            let finalizer_log = log.clone();
            ctx.add_finalizer(move |exit: RunExit| async move {
                let interrupted = if exit.interrupted { ":interrupted" } else { "" };
                finalizer_log.push(format!("wf:{run}:{}{interrupted}", kind(&exit.exit)));
            });
            let compensation_log = log.clone();
            ctx.activity("step", |_| async { Ok::<_, String>("held".to_owned()) })
                .compensate(move |value, cause| async move {
                    compensation_log.push(format!("comp:{run}:{value}:{}", cause_kind(&cause)));
                })
                .await?;
            match payload.to.as_str() {
                "fail" => Err("boom".to_owned()),
                "suspend" => {
                    let value =
                        ctx.await_deferred(&gate()).await.unwrap_or_else(|never| match never {});
                    if value == "fail" { Err("late boom".to_owned()) } else { Ok(value) }
                }
                "active" | "active-then-activity" => {
                    let long_log = log.clone();
                    ctx.activity("long", move |_| {
                        let (long, log) = (Arc::clone(&long), long_log.clone());
                        async move {
                            log.push("long:start");
                            long.acquire().await.unwrap().forget();
                            Ok::<_, String>(())
                        }
                    })
                    .await?;
                    if payload.to == "active-then-activity" {
                        let after_log = log.clone();
                        ctx.activity("after", move |_| {
                            let log = after_log.clone();
                            async move {
                                log.push("after");
                                Ok::<_, String>(())
                            }
                        })
                        .await?;
                    }
                    Ok("done".to_owned())
                }
                _ => Ok("done".to_owned()),
            }
        }
    })
    .unwrap();
}

/// One row of the matrix: how the execution is driven, and what observers must see.
struct Row {
    name: &'static str,
    to: &'static str,
    drive: Drive,
    result: &'static str,
    log: &'static [&'static str],
    /// Where the cluster engine differs (`effect/src/workflow/Workflow.ts`: `interruptUnsafe` while
    /// active).
    cluster_log: Option<&'static [&'static str]>,
}

#[derive(Clone, Copy)]
enum Drive {
    /// Nothing: the execution runs to its end.
    Nothing,
    /// Wait for the suspension, then complete the gate with this value.
    Open(&'static str),
    /// Wait for the suspension, then interrupt.
    InterruptSuspended,
    /// Wait for the long activity, interrupt (hard or not), then let the activity finish.
    InterruptActive { hard: bool },
}

const MATRIX: &[Row] = &[
    Row {
        name: "success, no suspension",
        to: "done",
        drive: Drive::Nothing,
        result: "success",
        log: &["run:1", "wf:1:success"],
        cluster_log: None,
    },
    Row {
        name: "typed failure after a step",
        to: "fail",
        drive: Drive::Nothing,
        result: "fail",
        log: &["run:1", "comp:1:held:fail", "wf:1:fail"],
        cluster_log: None,
    },
    Row {
        name: "suspend, then success",
        to: "suspend",
        drive: Drive::Open("ok"),
        result: "success",
        log: &["run:1", "run:2", "wf:2:success", "wf:1:success"],
        cluster_log: None,
    },
    Row {
        name: "suspend, then failure",
        to: "suspend",
        drive: Drive::Open("fail"),
        result: "fail",
        log: &["run:1", "run:2", "comp:2:held:fail", "wf:2:fail", "wf:1:success"],
        cluster_log: None,
    },
    Row {
        name: "safe interrupt while suspended",
        to: "suspend",
        drive: Drive::InterruptSuspended,
        result: "interrupt",
        log: &[
            "run:1",
            "run:2",
            "comp:2:held:interrupt",
            "wf:2:interrupt:interrupted",
            "wf:1:success",
        ],
        cluster_log: None,
    },
    Row {
        name: "safe interrupt while active, a later activity",
        to: "active-then-activity",
        drive: Drive::InterruptActive { hard: false },
        result: "interrupt",
        log: &["run:1", "long:start", "comp:1:held:interrupt", "wf:1:interrupt:interrupted"],
        cluster_log: None,
    },
    Row {
        name: "safe interrupt while active, nothing after",
        to: "active",
        drive: Drive::InterruptActive { hard: false },
        result: "success",
        log: &["run:1", "long:start", "wf:1:success"],
        cluster_log: None,
    },
    Row {
        name: "unsafe interrupt while active",
        to: "active-then-activity",
        drive: Drive::InterruptActive { hard: true },
        result: "interrupt",
        log: &["run:1", "long:start", "comp:1:held:interrupt", "wf:1:interrupt:interrupted"],
        // 4.1.0 cluster: the cut-off run is superseded (its workflow finalizer sees
        // success, its compensation is skipped) and the automatic re-run applies the
        // interrupt, compensating once (new in effect 4.1.0).
        cluster_log: Some(&[
            "run:1",
            "long:start",
            "run:2",
            "comp:2:held:interrupt",
            "wf:2:interrupt:interrupted",
            "wf:1:success",
        ]),
    },
];

pub(crate) async fn compensation_scenario_matrix(h: &impl Harness) {
    for row in MATRIX {
        let engine = h.engine().await;
        let (log, long) = (Log::default(), Arc::new(Semaphore::new(0)));
        register_saga(&engine, &log, &long);
        let id = engine.execute_discard::<Saga>(input_to(row.name, row.to)).await.unwrap();
        match row.drive {
            Drive::Nothing => {}
            Drive::Open(value) => {
                suspended::<Saga>(&engine, &id).await;
                open::<Saga>(&engine, &id, &gate(), value).await;
            }
            Drive::InterruptSuspended => {
                suspended::<Saga>(&engine, &id).await;
                engine.interrupt::<Saga>(&id).await.unwrap();
            }
            Drive::InterruptActive { hard } => {
                eventually("the long activity runs", || log.contains("long:start")).await;
                if hard {
                    engine.interrupt_unsafe::<Saga>(&id).await.unwrap();
                    if h.is_cluster() {
                        // The cut-off reaches the run through storage: the activity is let go
                        // only once it did, so the row sees the cut-off, not a race with it.
                        eventually("the cut-off run runs again", || log.contains("run:2")).await;
                    }
                } else {
                    engine.interrupt::<Saga>(&id).await.unwrap();
                }
                long.add_permits(1);
            }
        }
        let exit = complete_exit::<Saga>(&engine, &id).await;
        assert_eq!(kind(&exit), row.result, "{}: {exit:?}", row.name);
        let expected = match row.cluster_log {
            Some(log) if h.is_cluster() => log,
            _ => row.log,
        };
        assert_eq!(log.entries(), expected, "{}", row.name);
        engine.shutdown().await;
    }
}

pub(crate) async fn compensations_run_in_reverse_order_with_the_cause(h: &impl Harness) {
    workflow!(Ordered, (), String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Ordered::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                for step in ["reserve", "charge", "ship"] {
                    let log = log.clone();
                    ctx.activity(step, move |_| async move { Ok::<_, String>(step.to_owned()) })
                        .compensate(move |value, cause| async move {
                            let error: Option<String> = cause.error();
                            log.push(format!("undo:{value}:{}", error.unwrap_or_default()));
                        })
                        .await?;
                }
                Err("no courier".to_owned())
            }
        })
        .unwrap();
    }
    let result = engine.execute::<Ordered>(input("saga")).await;
    assert!(
        matches!(&result, Err(ExecuteError::Failed(error)) if error == "no courier"),
        "{result:?}"
    );
    assert_eq!(
        log.entries(),
        ["undo:ship:no courier", "undo:charge:no courier", "undo:reserve:no courier"]
    );
}

// ---------------------------------------------------------------------------------------
// Races (effect's `ClusterWorkflowEngine.test.ts`)

type Branch<'a> = BoxFuture<'a, Result<String, String>>;

/// An activity branch that sleeps `seconds` and returns `name`, logging when it starts and
/// when it is dropped before finishing.
fn sleeper<'a>(ctx: &'a WorkflowContext, log: &Log, name: &'static str, millis: u64) -> Branch<'a> {
    let log = log.clone();
    Box::pin(
        ctx.activity(name, move |_| {
            let log = log.clone();
            async move {
                log.push(format!("{name}:start"));
                let interrupted = OnDrop(log.clone(), format!("{name}:interrupted"));
                tokio::time::sleep(ms(millis)).await;
                std::mem::forget(interrupted);
                Ok(name.to_owned())
            }
        })
        .into_future(),
    )
}

fn await_branch<'a>(
    ctx: &'a WorkflowContext,
    deferred: DurableDeferred<String>,
    suffix: &'static str,
) -> Branch<'a> {
    Box::pin(async move {
        let value = ctx.await_deferred(&deferred).await.unwrap_or_else(|never| match never {});
        Ok(format!("{value}{suffix}"))
    })
}

pub(crate) async fn activity_race_returns_the_first_success_and_drops_the_losers(h: &impl Harness) {
    workflow!(Racer, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Racer::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                let branches = vec![
                    sleeper(&ctx, &log, "Activity1", 1_000),
                    sleeper(&ctx, &log, "Activity2", 500),
                    sleeper(&ctx, &log, "Activity3", 100),
                ];
                ctx.race("race", branches).await
            }
        })
        .unwrap();
    }
    assert_eq!(engine.execute::<Racer>(input("r")).await.unwrap(), "Activity3");
    assert!(log.contains("Activity1:interrupted"), "{:?}", log.entries());
    assert!(log.contains("Activity2:interrupted"), "{:?}", log.entries());
    assert!(!log.contains("Activity3:interrupted"));
}

pub(crate) async fn activity_race_ignores_a_failure_when_another_branch_succeeds(h: &impl Harness) {
    workflow!(Resilient, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Resilient::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                let failing: Branch<'_> = Box::pin(
                    ctx.activity("fails", |_| async { Err::<String, _>("boom".to_owned()) })
                        .into_future(),
                );
                ctx.race("race", vec![failing, sleeper(&ctx, &log, "slow", 1_000)]).await
            }
        })
        .unwrap();
    }
    assert_eq!(engine.execute::<Resilient>(input("r")).await.unwrap(), "slow");
}

pub(crate) async fn activity_race_fails_when_every_branch_fails(h: &impl Harness) {
    workflow!(Doomed, String, String);
    let engine = h.engine().await;
    Doomed::register(&engine, |ctx: WorkflowContext, _: Input| async move {
        let first: Branch<'_> = Box::pin(
            ctx.activity("a", |_| async { Err::<String, _>("a".to_owned()) }).into_future(),
        );
        let second: Branch<'_> = Box::pin(async {
            tokio::time::sleep(ms(1000)).await;
            Err("b".to_owned())
        });
        ctx.race("race", vec![first, second]).await
    })
    .unwrap();
    let result = engine.execute::<Doomed>(input("d")).await;
    assert!(matches!(&result, Err(ExecuteError::Failed(error)) if error == "b"), "{result:?}");
}

workflow!(DeferredRacer, String, String);

fn register_deferred_racer(engine: &WorkflowEngine, log: &Log, millis: u64) {
    let log = log.clone();
    DeferredRacer::register(engine, move |ctx: WorkflowContext, _: Input| {
        let log = log.clone();
        async move {
            log.push("run");
            let winner = ctx
                .race(
                    "race",
                    vec![await_branch(&ctx, gate(), ""), sleeper(&ctx, &log, "activity", millis)],
                )
                .await?;
            let tail_log = log.clone();
            let tail: String = ctx
                .activity("tail", move |_| {
                    let log = tail_log.clone();
                    async move {
                        log.push("tail:start");
                        tokio::time::sleep(ms(10000)).await;
                        Ok::<_, String>("tail".to_owned())
                    }
                })
                .await?;
            Ok(format!("{winner}:{tail}"))
        }
    })
    .unwrap();
}

pub(crate) async fn deferred_race_lets_a_deferred_win_while_a_branch_is_active(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_deferred_racer(&engine, &log, 5_000);
    let id = engine.execute_discard::<DeferredRacer>(input("d")).await.unwrap();
    eventually("the activity branch runs", || log.contains("activity:start")).await;
    open::<DeferredRacer>(&engine, &id, &gate(), "signal").await;
    assert_eq!(complete_exit::<DeferredRacer>(&engine, &id).await, success("signal:tail"));
    let runs = log.count("run");
    assert!((1..=2).contains(&runs), "{runs} runs");
}

pub(crate) async fn deferred_race_lets_an_active_branch_win(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_deferred_racer(&engine, &log, 1_000);
    assert_eq!(engine.execute::<DeferredRacer>(input("a")).await.unwrap(), "activity:tail");
}

pub(crate) async fn a_late_completion_of_a_losing_deferred_does_not_preempt(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_deferred_racer(&engine, &log, 1_000);
    let id = engine.execute_discard::<DeferredRacer>(input("late")).await.unwrap();
    eventually("the tail runs", || log.contains("tail:start")).await;
    open::<DeferredRacer>(&engine, &id, &gate(), "signal").await;
    assert_eq!(complete_exit::<DeferredRacer>(&engine, &id).await, success("activity:tail"));
    // 4.1.0: the settled race released its wait, so the late completion preempts nothing.
    assert_eq!(log.count("tail:start"), 1, "{:?}", log.entries());
    assert_eq!(log.count("run"), 1);
}

pub(crate) async fn a_race_replays_its_recorded_winner(h: &impl Harness) {
    workflow!(Recorded, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Recorded::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                log.push("run");
                let winner = ctx
                    .race(
                        "race",
                        vec![
                            sleeper(&ctx, &log, "slow", 50_000),
                            sleeper(&ctx, &log, "fast", 1_000),
                        ],
                    )
                    .await?;
                let tail: DurableDeferred<String> = DurableDeferred::new("Tail").unwrap();
                let tail = ctx.await_deferred(&tail).await.unwrap_or_else(|never| match never {});
                Ok(format!("{winner}:{tail}"))
            }
        })
        .unwrap();
    }
    let id = engine.execute_discard::<Recorded>(input("r")).await.unwrap();
    suspended::<Recorded>(&engine, &id).await;
    let starts = (log.count("slow:start"), log.count("fast:start"));
    open::<Recorded>(&engine, &id, &DurableDeferred::new("Tail").unwrap(), "after").await;
    assert_eq!(complete_exit::<Recorded>(&engine, &id).await, success("fast:after"));
    assert_eq!(log.count("run"), 2);
    // The replay took the recorded winner without entering any branch.
    assert_eq!((log.count("slow:start"), log.count("fast:start")), starts);
}

pub(crate) async fn a_race_suspends_when_every_branch_waits(h: &impl Harness) {
    workflow!(Waiting, String, String);
    let engine = h.engine().await;
    Waiting::register(&engine, |ctx: WorkflowContext, _: Input| async move {
        let a = await_branch(&ctx, DurableDeferred::new("A").unwrap(), "-a");
        let b = await_branch(&ctx, DurableDeferred::new("B").unwrap(), "-b");
        ctx.race("race", vec![a, b]).await
    })
    .unwrap();
    let id = engine.execute_discard::<Waiting>(input("w")).await.unwrap();
    suspended::<Waiting>(&engine, &id).await;
    open::<Waiting>(&engine, &id, &DurableDeferred::new("B").unwrap(), "signal").await;
    assert_eq!(complete_exit::<Waiting>(&engine, &id).await, success("signal-b"));
}

pub(crate) async fn awaits_inside_an_activity_do_not_preempt_the_run(h: &impl Harness) {
    workflow!(Inner, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Inner::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                log.push("run");
                let clocked: Branch<'_> = Box::pin(
                    ctx.activity("clocked", |activity| async move {
                        activity
                            .context()
                            .sleep_with_threshold("inner", ms(5000), Duration::ZERO)
                            .await;
                        Ok::<_, String>("clock".to_owned())
                    })
                    .into_future(),
                );
                ctx.race("race", vec![clocked, sleeper(&ctx, &log, "slow", 30_000)]).await
            }
        })
        .unwrap();
    }
    assert_eq!(engine.execute::<Inner>(input("i")).await.unwrap(), "slow");
    assert_eq!(log.count("run"), 1, "the clock inside the activity did not preempt the run");
}

// ---------------------------------------------------------------------------------------
// Children (effect's `ClusterWorkflowEngine.test.ts`)

workflow!(Child, String, String);
workflow!(Parent, String, String);

fn child_deferred() -> DurableDeferred<String> {
    DurableDeferred::new("ChildDeferred").unwrap()
}

fn register_family(engine: &WorkflowEngine, log: &Log) {
    let child_log = log.clone();
    Child::register(engine, move |ctx: WorkflowContext, _: Input| {
        let log = child_log.clone();
        async move {
            log.push("child:run");
            let value =
                ctx.await_deferred(&child_deferred()).await.unwrap_or_else(|never| match never {});
            Ok(format!("child:{value}"))
        }
    })
    .unwrap();
    let parent_log = log.clone();
    Parent::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let log = parent_log.clone();
        async move {
            log.push("parent:run");
            let _body = BodyFinalizer { ctx: ctx.clone(), log: log.clone() };
            let value = ctx.child::<Child>(input(&format!("{}-child", payload.key))).await?;
            Ok(format!("parent:{value}"))
        }
    })
    .unwrap();
}

pub(crate) async fn a_child_completion_wakes_its_parent(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_family(&engine, &log);
    let id = engine.execute_discard::<Parent>(input("p")).await.unwrap();
    let child = Child::execution_id(&input("p-child"));
    suspended::<Child>(&engine, &child).await;
    suspended::<Parent>(&engine, &id).await;
    assert!(
        log.contains("body:true:false"),
        "the parent's body saw its suspension: {:?}",
        log.entries()
    );
    open::<Child>(&engine, &child, &child_deferred(), "value").await;
    assert_eq!(complete_exit::<Child>(&engine, &child).await, success("child:value"));
    assert_eq!(complete_exit::<Parent>(&engine, &id).await, success("parent:child:value"));
    assert_eq!(log.count("child:run"), 2);
}

pub(crate) async fn an_interrupted_parent_interrupts_its_child(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_family(&engine, &log);
    let id = engine.execute_discard::<Parent>(input("q")).await.unwrap();
    let child = Child::execution_id(&input("q-child"));
    suspended::<Child>(&engine, &child).await;
    suspended::<Parent>(&engine, &id).await;
    engine.interrupt::<Parent>(&id).await.unwrap();
    assert_eq!(kind(&complete_exit::<Parent>(&engine, &id).await), "interrupt");
    assert_eq!(kind(&complete_exit::<Child>(&engine, &child).await), "interrupt");
}

pub(crate) async fn an_interrupted_child_wakes_its_parent_with_a_result(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_family(&engine, &log);
    let id = engine.execute_discard::<Parent>(input("c")).await.unwrap();
    let child = Child::execution_id(&input("c-child"));
    suspended::<Child>(&engine, &child).await;
    suspended::<Parent>(&engine, &id).await;
    engine.interrupt::<Child>(&child).await.unwrap();
    assert_eq!(kind(&complete_exit::<Child>(&engine, &child).await), "interrupt");
    // The parent is woken (Appendix C #1) and the child's interrupt, re-raised in the parent,
    // completes it instead of leaving it without a result (Appendix C #2).
    assert_eq!(kind(&complete_exit::<Parent>(&engine, &id).await), "interrupt");
    assert_eq!(log.count("parent:run"), 2);
}

// ---------------------------------------------------------------------------------------
// SuspendOnFailure (effect's `ClusterWorkflowEngine.test.ts`)

fn suspend_on_failure() -> WorkflowOptions {
    WorkflowOptions { suspend_on_failure: true, ..WorkflowOptions::default() }
}

workflow!(Flaky, String, String, suspend_on_failure());

fn register_flaky(engine: &WorkflowEngine, log: &Log, in_activity: bool) {
    let log = log.clone();
    let failures = Arc::new(AtomicU32::new(1));
    Flaky::register(engine, move |ctx: WorkflowContext, _: Input| {
        let (log, failures) = (log.clone(), Arc::clone(&failures));
        async move {
            log.push("run");
            if in_activity {
                let failures = Arc::clone(&failures);
                ctx.activity("flaky", move |_| {
                    let failures = Arc::clone(&failures);
                    async move {
                        if failures.fetch_sub(1, Ordering::SeqCst) > 0 {
                            return Err("boom".to_owned());
                        }
                        Ok::<_, String>("recovered".to_owned())
                    }
                })
                .await
            } else {
                let _ = ctx
                    .await_deferred(&DurableDeferred::<String>::new("Never").unwrap())
                    .await
                    .ok()
                    .filter(|_| false);
                Err("boom".to_owned())
            }
        }
    })
    .unwrap();
}

fn failed_suspension(result: &WorkflowResult) -> bool {
    match result {
        WorkflowResult::Suspended { failed: true, cause: Some(cause) } => {
            FailureCause(cause.clone()).defect() == Some("\"boom\"")
        }
        _ => false,
    }
}

pub(crate) async fn suspend_on_failure_suspends_and_an_explicit_resume_replays(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_flaky(&engine, &log, true);
    let id = engine.execute_discard::<Flaky>(input("f")).await.unwrap();
    let result = suspended::<Flaky>(&engine, &id).await;
    assert!(failed_suspension(&result), "{result:?}");
    engine.resume::<Flaky>(&id).await.unwrap();
    assert_eq!(complete_exit::<Flaky>(&engine, &id).await, success("recovered"));
    assert_eq!(log.count("run"), 2);
}

workflow!(AlwaysFails, String, String, suspend_on_failure());

pub(crate) async fn interrupting_a_failed_suspension_keeps_the_original_failure(h: &impl Harness) {
    let engine = h.engine().await;
    AlwaysFails::register(&engine, |_: WorkflowContext, _: Input| async {
        Err::<String, _>("boom".to_owned())
    })
    .unwrap();
    let id = engine.execute_discard::<AlwaysFails>(input("a")).await.unwrap();
    let result = suspended::<AlwaysFails>(&engine, &id).await;
    assert!(failed_suspension(&result), "{result:?}");
    engine.interrupt::<AlwaysFails>(&id).await.unwrap();
    let exit = complete_exit::<AlwaysFails>(&engine, &id).await;
    assert_eq!(exit, Exit::fail(RawJson::encode("boom").unwrap()), "the interrupt is filtered out");
}

pub(crate) async fn automatic_wakes_do_not_resume_a_failed_suspension(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_flaky(&engine, &log, true);
    let id = engine.execute_discard::<Flaky>(input("auto")).await.unwrap();
    suspended::<Flaky>(&engine, &id).await;
    // A completion is an automatic wake: it must not replay a failed suspension.
    open::<Flaky>(&engine, &id, &gate(), "ignored").await;
    tokio::time::sleep(ms(1000)).await;
    assert_eq!(log.count("run"), 1);
    assert!(failed_suspension(&engine.poll::<Flaky>(&id).await.unwrap().unwrap()));
    engine.resume::<Flaky>(&id).await.unwrap();
    assert_eq!(complete_exit::<Flaky>(&engine, &id).await, success("recovered"));
}

// ---------------------------------------------------------------------------------------
// Defects (effect's `ClusterWorkflowEngine.test.ts`)

pub(crate) async fn a_caught_activity_defect_lets_the_workflow_go_on(h: &impl Harness) {
    workflow!(Catcher, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Catcher::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                let died = ctx
                    .activity("dies", |_| async {
                        if true {
                            panic!("Batch request error: Request timed out");
                        }
                        Ok::<String, String>(String::new())
                    })
                    .catch_defects()
                    .await;
                let Err(ActivityError::Defect(defect)) = died else {
                    return Err("no defect".to_owned());
                };
                log.push("catch");
                ctx.activity("log", move |_| {
                    let defect = defect.clone();
                    async move { Ok::<_, String>(defect) }
                })
                .await
            }
        })
        .unwrap();
    }
    let defect = engine.execute::<Catcher>(input("c")).await.unwrap();
    assert!(defect.contains("Batch request error: Request timed out"), "{defect}");
    assert!(log.contains("catch"));
}

pub(crate) async fn an_uncaught_activity_defect_completes_with_a_die(h: &impl Harness) {
    workflow!(Dies, String, String);
    let engine = h.engine().await;
    Dies::register(&engine, |ctx: WorkflowContext, _: Input| async move {
        ctx.activity("dies", |_| async {
            if true {
                panic!("Batch request error: Request timed out");
            }
            Ok::<String, String>(String::new())
        })
        .await
    })
    .unwrap();
    let result = engine.execute::<Dies>(input("d")).await;
    match result {
        Err(ExecuteError::Defect(defect)) => {
            assert!(defect.contains("Batch request error: Request timed out"), "{defect}");
        }
        other => panic!("{other:?}"),
    }
}

pub(crate) async fn without_capture_defects_a_defect_leaves_no_result(h: &impl Harness) {
    workflow!(
        Uncaptured,
        String,
        String,
        WorkflowOptions { capture_defects: false, ..WorkflowOptions::default() }
    );
    let engine = h.engine().await;
    Uncaptured::register(&engine, |_: WorkflowContext, _: Input| async {
        if true {
            panic!("lost");
        }
        Ok(String::new())
    })
    .unwrap();
    let id = engine.execute_discard::<Uncaptured>(input("u")).await.unwrap();
    let mut polled = engine.poll::<Uncaptured>(&id).await;
    for _ in 0..100 {
        if polled.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        polled = engine.poll::<Uncaptured>(&id).await;
    }
    assert!(matches!(polled, Err(WorkflowError::NoResult(_))), "{polled:?}");
    let result = engine.execute::<Uncaptured>(input("u")).await;
    assert!(matches!(result, Err(ExecuteError::Engine(WorkflowError::NoResult(_)))), "{result:?}");
}

pub(crate) async fn a_body_panic_is_a_defect(h: &impl Harness) {
    workflow!(Panics, String, String);
    let engine = h.engine().await;
    Panics::register(&engine, |_: WorkflowContext, _: Input| async {
        if true {
            panic!("body panic");
        }
        Ok(String::new())
    })
    .unwrap();
    let result = engine.execute::<Panics>(input("p")).await;
    assert!(
        matches!(&result, Err(ExecuteError::Defect(defect)) if defect.contains("body panic")),
        "{result:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Activities, deferreds and clocks

pub(crate) async fn retries_number_attempts_and_keep_the_last_error(h: &impl Harness) {
    #[derive(Debug, Serialize, Deserialize)]
    pub(crate) struct RetryError {
        attempt: u32,
    }
    workflow!(Retried, u32, RetryError);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Retried::register(&engine, move |ctx: WorkflowContext, payload: Input| {
            let log = log.clone();
            async move {
                ctx.activity("retried", move |activity| {
                    let (log, succeed) = (log.clone(), payload.to == "succeed");
                    async move {
                        let attempt = activity.attempt();
                        log.push(format!("attempt:{attempt}"));
                        if succeed && attempt == 3 {
                            Ok(attempt)
                        } else {
                            Err(RetryError { attempt })
                        }
                    }
                })
                .retry(2)
                .await
            }
        })
        .unwrap();
    }
    assert_eq!(engine.execute::<Retried>(input_to("s", "succeed")).await.unwrap(), 3);
    assert_eq!(log.entries(), ["attempt:1", "attempt:2", "attempt:3"]);
    let failed = engine.execute::<Retried>(input_to("f", "fail")).await;
    assert!(matches!(failed, Err(ExecuteError::Failed(RetryError { attempt: 3 }))), "{failed:?}");
    assert_eq!(log.entries().len(), 6);
}

/// The reference's interrupt retry policy (`effect/src/workflow/Activity.ts`,
/// `retryOnInterrupt`): a body whose run ends by an interrupt runs again after
/// `min(400 ms × 1.5ⁿ, 10 s)`, and the activity completes with the result of the run that
/// finished.
pub(crate) async fn an_interrupted_activity_runs_again_and_completes(h: &impl Harness) {
    workflow!(Interrupted, u32, String);
    let engine = h.engine().await;
    let runs = Arc::new(AtomicU32::new(0));
    {
        let runs = Arc::clone(&runs);
        Interrupted::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let runs = Arc::clone(&runs);
            async move {
                ctx.activity("cut", move |activity| {
                    let runs = Arc::clone(&runs);
                    async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        if run < 3 {
                            // As after a call the callee's lost shard interrupted.
                            return activity.interrupt().await;
                        }
                        Ok::<_, String>(run)
                    }
                })
                .await
            }
        })
        .unwrap();
    }
    let started = tokio::time::Instant::now();
    assert_eq!(engine.execute::<Interrupted>(input("i")).await.unwrap(), 3);
    assert_eq!(runs.load(Ordering::SeqCst), 3, "two interrupted runs, then the one that finished");
    // The default policy waits 400 ms, then 600 ms (a paused clock: exact and instant).
    assert!(started.elapsed() >= Duration::from_millis(1000), "{:?}", started.elapsed());
    // The result is the activity's: executing again does not run it.
    assert_eq!(engine.execute::<Interrupted>(input("i")).await.unwrap(), 3);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// The interrupt retry layer leaves failures of the body's own alone: an error and a panic
/// are the activity's result after one run.
pub(crate) async fn an_activity_failing_on_its_own_is_not_retried_on_interrupt(h: &impl Harness) {
    workflow!(FailsAlone, String, String);
    let engine = h.engine().await;
    let runs = Arc::new(AtomicU32::new(0));
    {
        let runs = Arc::clone(&runs);
        FailsAlone::register(&engine, move |ctx: WorkflowContext, payload: Input| {
            let runs = Arc::clone(&runs);
            async move {
                let panics = payload.to == "panic";
                let outcome = ctx
                    .activity("fails", move |_| {
                        let runs = Arc::clone(&runs);
                        async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            if panics {
                                panic!("the body broke");
                            }
                            Err::<String, String>("declined".to_owned())
                        }
                    })
                    .catch_defects()
                    .await;
                match outcome {
                    Ok(value) => Ok(value),
                    Err(ActivityError::Failed(error)) => Err(error),
                    Err(ActivityError::Defect(defect)) => Ok(format!("defect:{defect}")),
                }
            }
        })
        .unwrap();
    }
    let failed = engine.execute::<FailsAlone>(input_to("f", "fail")).await;
    assert!(
        matches!(&failed, Err(ExecuteError::Failed(error)) if error == "declined"),
        "{failed:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "an error is not retried");
    let died = engine.execute::<FailsAlone>(input_to("p", "panic")).await.unwrap();
    assert!(died.contains("the body broke"), "{died}");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "a panic is not retried");
}

/// A body interrupted on every run dies once the policy's retries are used up, with the
/// reference's defect.
pub(crate) async fn an_activity_interrupted_past_its_retries_dies(h: &impl Harness) {
    workflow!(AlwaysCut, String, String);
    let engine = h.engine().await;
    let runs = Arc::new(AtomicU32::new(0));
    {
        let runs = Arc::clone(&runs);
        AlwaysCut::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let runs = Arc::clone(&runs);
            async move {
                let policy = InterruptRetry {
                    max_retries: 2,
                    first_delay: ms(100),
                    ..InterruptRetry::default()
                };
                let outcome = ctx
                    .activity("always", move |activity| {
                        let runs = Arc::clone(&runs);
                        async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            activity.interrupt::<Result<String, String>>().await
                        }
                    })
                    .interrupt_retry(policy)
                    .catch_defects()
                    .await;
                match outcome {
                    Err(ActivityError::Defect(defect)) => Ok(defect),
                    other => Err(format!("{other:?}")),
                }
            }
        })
        .unwrap();
    }
    let defect = engine.execute::<AlwaysCut>(input("a")).await.unwrap();
    assert_eq!(defect, r#""Activity \"always\" interrupted and retry attempts exhausted""#);
    assert_eq!(runs.load(Ordering::SeqCst), 3, "the first run and two retries");
}

pub(crate) async fn concurrent_activities_with_one_name_run_once(h: &impl Harness) {
    workflow!(Twice, (u64, u64), String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Twice::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                let body = |_| {
                    let log = log.clone();
                    async move {
                        log.push("body");
                        tokio::time::sleep(ms(100)).await;
                        Ok::<u64, String>(7)
                    }
                };
                let (a, b) = tokio::join!(
                    ctx.activity("same", body).into_future(),
                    ctx.activity("same", body).into_future()
                );
                Ok((a?, b?))
            }
        })
        .unwrap();
    }
    assert_eq!(engine.execute::<Twice>(input("t")).await.unwrap(), (7, 7));
    assert_eq!(log.count("body"), 1);
}

pub(crate) async fn concurrent_activities_finish_before_the_run_suspends(h: &impl Harness) {
    workflow!(Concurrent, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Concurrent::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                let slow_log = log.clone();
                let slow = ctx.activity("slow", move |_| {
                    let log = slow_log.clone();
                    async move {
                        log.push("slow:start");
                        tokio::time::sleep(ms(5000)).await;
                        log.push("slow:done");
                        Ok::<_, String>("slow".to_owned())
                    }
                });
                let gate = gate();
                let (slow, signal) = tokio::join!(slow.into_future(), ctx.await_deferred(&gate));
                let signal = signal.unwrap_or_else(|never| match never {});
                Ok(format!("{}:{signal}", slow?))
            }
        })
        .unwrap();
    }
    let id = engine.execute_discard::<Concurrent>(input("c")).await.unwrap();
    suspended::<Concurrent>(&engine, &id).await;
    assert!(log.contains("slow:done"), "the activity finished before the suspension");
    open::<Concurrent>(&engine, &id, &gate(), "go").await;
    assert_eq!(complete_exit::<Concurrent>(&engine, &id).await, success("slow:go"));
    assert_eq!(log.count("slow:start"), 1, "the completed activity did not run again");
}

pub(crate) async fn durable_sleep_wakes_the_run(h: &impl Harness) {
    workflow!(Sleeper, (), Never);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Sleeper::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                log.push("run");
                ctx.sleep_with_threshold("nap", ms(120_000), ms(60_000)).await;
                ctx.sleep("zero", Duration::ZERO).await;
                Ok(())
            }
        })
        .unwrap();
    }
    let start = tokio::time::Instant::now();
    let id = engine.execute_discard::<Sleeper>(input("s")).await.unwrap();
    suspended::<Sleeper>(&engine, &id).await;
    assert_eq!(complete_exit::<Sleeper>(&engine, &id).await, Exit::void());
    assert!(start.elapsed() >= ms(120000), "{:?}", start.elapsed());
    assert_eq!(log.count("run"), 2);
}

pub(crate) async fn short_sleeps_are_activities(h: &impl Harness) {
    workflow!(Napper, (), Never);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Napper::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                log.push("run");
                ctx.sleep_with_threshold("short", ms(10_000), ms(60_000)).await;
                Ok(())
            }
        })
        .unwrap();
    }
    let start = tokio::time::Instant::now();
    engine.execute::<Napper>(input("n")).await.unwrap();
    assert!(start.elapsed() >= ms(10000));
    assert_eq!(log.count("run"), 1, "an in-memory sleep does not suspend");
}

pub(crate) async fn first_completion_wins(h: &impl Harness) {
    workflow!(Firsts, String, Never);
    let engine = h.engine().await;
    Firsts::register(&engine, |ctx: WorkflowContext, _: Input| async move {
        ctx.await_deferred(&gate()).await
    })
    .unwrap();
    let id = engine.execute_discard::<Firsts>(input("f")).await.unwrap();
    suspended::<Firsts>(&engine, &id).await;
    open::<Firsts>(&engine, &id, &gate(), "first").await;
    open::<Firsts>(&engine, &id, &gate(), "second").await;
    assert_eq!(complete_exit::<Firsts>(&engine, &id).await, success("first"));
}

pub(crate) async fn interrupting_unknown_or_completed_executions_is_a_no_op(h: &impl Harness) {
    let engine = h.engine().await;
    register_doubler(&engine, &Log::default());
    engine.interrupt::<Doubler>(&ExecutionId::derive("Doubler", "nobody")).await.unwrap();
    assert_eq!(
        engine.poll::<Doubler>(&ExecutionId::derive("Doubler", "nobody")).await.unwrap(),
        None
    );
    let payload = Input { value: 4, ..input("done") };
    let id = Doubler::execution_id(&payload);
    assert_eq!(engine.execute::<Doubler>(payload).await.unwrap(), 8);
    engine.interrupt::<Doubler>(&id).await.unwrap();
    engine.interrupt_unsafe::<Doubler>(&id).await.unwrap();
    engine.resume::<Doubler>(&id).await.unwrap();
    assert_eq!(
        engine.poll::<Doubler>(&id).await.unwrap(),
        Some(WorkflowResult::Complete(success(8)))
    );
}

pub(crate) async fn unregistered_workflows_are_an_error(h: &impl Harness) {
    let engine = h.engine().await;
    if h.is_cluster() {
        // As in the reference, a runner that owns the shard answers a request for an entity
        // type it never registers with a defect once the registration timeout passed: the
        // execution's final reply, which its caller gets as a defect.
        let result = engine.execute::<Doubler>(input("x")).await;
        assert!(
            matches!(&result, Err(ExecuteError::Defect(defect))
                if defect.contains("Entity type 'Workflow/Doubler' not registered")),
            "{result:?}"
        );
        register_doubler(&engine, &Log::default());
    } else {
        let result = engine.execute::<Doubler>(input("x")).await;
        assert!(
            matches!(result, Err(ExecuteError::Engine(WorkflowError::NotRegistered(name))) if name == "Doubler")
        );
        register_doubler(&engine, &Log::default());
    }
    let twice = Doubler::register(&engine, |_: WorkflowContext, _: Input| async { Ok(0) });
    assert!(matches!(twice, Err(WorkflowError::Invalid(_))));
}

// ---------------------------------------------------------------------------------------
// Durable queues (effect's `DurableQueue.test.ts`)

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Item {
    id: String,
    value: u64,
}

const API_QUEUE: cluster_workflow::DurableQueue<Item, u64, String> =
    cluster_workflow::DurableQueue::new("ApiQueue", |item: &Item| item.id.clone());

workflow!(Queued, u64, String);

fn register_queued(engine: &WorkflowEngine, log: &Log) {
    let run_log = log.clone();
    Queued::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let log = run_log.clone();
        async move {
            log.push("run");
            let item = Item { id: "api-call-1".into(), value: payload.value };
            let result = API_QUEUE.process(&ctx, item).await?;
            if payload.to == "gate" {
                let _ = ctx.await_deferred(&gate()).await;
            }
            Ok(result)
        }
    })
    .unwrap();
    let log = log.clone();
    engine
        .register_queue_worker(
            API_QUEUE,
            move |item: Item| {
                let log = log.clone();
                async move {
                    log.push("worker");
                    if item.value == 0 { Err("boom".to_owned()) } else { Ok(item.value + 1) }
                }
            },
            2,
        )
        .unwrap();
}

pub(crate) async fn a_queue_worker_result_resumes_the_workflow(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_queued(&engine, &log);
    let id = engine.execute_discard::<Queued>(Input { value: 41, ..input("q") }).await.unwrap();
    assert_eq!(complete_exit::<Queued>(&engine, &id).await, success(42));
    assert_eq!(log.count("worker"), 1);
}

pub(crate) async fn a_queue_worker_failure_fails_the_workflow(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_queued(&engine, &log);
    let id = engine.execute_discard::<Queued>(Input { value: 0, ..input("f") }).await.unwrap();
    let exit = complete_exit::<Queued>(&engine, &id).await;
    assert_eq!(exit, Exit::fail(RawJson::encode("boom").unwrap()));
}

pub(crate) async fn a_queue_item_is_offered_once_across_replays(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    register_queued(&engine, &log);
    let id = engine
        .execute_discard::<Queued>(Input { value: 9, key: "once".into(), to: "gate".into() })
        .await
        .unwrap();
    eventually("the item was processed", || log.contains("worker")).await;
    suspended::<Queued>(&engine, &id).await;
    open::<Queued>(&engine, &id, &gate(), "go").await;
    assert_eq!(complete_exit::<Queued>(&engine, &id).await, success(10));
    assert!(log.count("run") >= 2, "{:?}", log.entries());
    assert_eq!(log.count("worker"), 1, "the replay offered the same item");
}

// ---------------------------------------------------------------------------------------
// More races (effect's `ClusterWorkflowEngine.test.ts`)

/// #13: a durable clock in the workflow (not in an activity) wins against a long activity:
/// its completion preempts and replays the run.
pub(crate) async fn a_bare_durable_clock_branch_wins(h: &impl Harness) {
    workflow!(ClockRace, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        ClockRace::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                let clock: Branch<'_> = Box::pin(async {
                    ctx.sleep_with_threshold("short", ms(5_000), Duration::ZERO).await;
                    Ok("clock".to_owned())
                });
                ctx.race("race", vec![clock, sleeper(&ctx, &log, "slow", 30_000)]).await
            }
        })
        .unwrap();
    }
    assert_eq!(engine.execute::<ClockRace>(input("c")).await.unwrap(), "clock");
}

/// #14 and #15: a branch's own steps (an activity before its await, a mapping after it) run
/// again on the replay that the completion causes.
pub(crate) async fn a_waking_branch_runs_its_own_steps_again(h: &impl Harness) {
    workflow!(Steps, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        Steps::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                let branch: Branch<'_> = Box::pin(async {
                    let act: String = ctx
                        .activity("act", |_| async { Ok::<_, String>("act".to_owned()) })
                        .await?;
                    let value =
                        ctx.await_deferred(&gate()).await.unwrap_or_else(|never| match never {});
                    Ok(format!("{act}:{value}!"))
                });
                ctx.race("race", vec![branch, sleeper(&ctx, &log, "slow", 30_000)]).await
            }
        })
        .unwrap();
    }
    let id = engine.execute_discard::<Steps>(input("s")).await.unwrap();
    eventually("the slow branch runs", || log.contains("slow:start")).await;
    open::<Steps>(&engine, &id, &gate(), "signal").await;
    assert_eq!(complete_exit::<Steps>(&engine, &id).await, success("act:signal!"));
}

/// #16: a branch that awaits A then B replays once per completion.
pub(crate) async fn a_multi_await_branch_replays_per_completion(h: &impl Harness) {
    workflow!(TwoAwaits, String, String);
    let engine = h.engine().await;
    let log = Log::default();
    {
        let log = log.clone();
        TwoAwaits::register(&engine, move |ctx: WorkflowContext, _: Input| {
            let log = log.clone();
            async move {
                log.push("run");
                let branch: Branch<'_> = Box::pin(async {
                    let a = ctx.await_deferred(&DurableDeferred::<String>::new("A").unwrap()).await;
                    let b = ctx.await_deferred(&DurableDeferred::<String>::new("B").unwrap()).await;
                    let (Ok(a), Ok(b)) = (a, b);
                    Ok(format!("{a}:{b}"))
                });
                let never: Branch<'_> = Box::pin(std::future::pending());
                ctx.race("race", vec![branch, never]).await
            }
        })
        .unwrap();
    }
    let id = engine.execute_discard::<TwoAwaits>(input("m")).await.unwrap();
    eventually("the first run", || log.contains("run")).await;
    open::<TwoAwaits>(&engine, &id, &DurableDeferred::new("A").unwrap(), "a").await;
    eventually("the replay after A", || log.count("run") >= 2).await;
    open::<TwoAwaits>(&engine, &id, &DurableDeferred::new("B").unwrap(), "b").await;
    assert_eq!(complete_exit::<TwoAwaits>(&engine, &id).await, success("a:b"));
    let runs = log.count("run");
    assert!((2..=3).contains(&runs), "{runs} runs");
}

/// A race whose branches all wait durably, one of them inside an activity, suspends the run;
/// the activity's completion then wins on the replay.
pub(crate) async fn a_race_of_waiting_activities_suspends(h: &impl Harness) {
    workflow!(WaitingActivity, String, String);
    let engine = h.engine().await;
    WaitingActivity::register(&engine, |ctx: WorkflowContext, _: Input| async move {
        let inside: Branch<'_> = Box::pin(
            ctx.activity("inside", |activity| async move {
                let value = activity
                    .context()
                    .await_deferred(&DurableDeferred::<String>::new("X").unwrap())
                    .await
                    .unwrap_or_else(|never| match never {});
                Ok::<_, String>(format!("activity:{value}"))
            })
            .into_future(),
        );
        let outside = await_branch(&ctx, DurableDeferred::new("Y").unwrap(), ":outside");
        ctx.race("race", vec![inside, outside]).await
    })
    .unwrap();
    let id = engine.execute_discard::<WaitingActivity>(input("w")).await.unwrap();
    suspended::<WaitingActivity>(&engine, &id).await;
    open::<WaitingActivity>(&engine, &id, &DurableDeferred::new("X").unwrap(), "x").await;
    assert_eq!(complete_exit::<WaitingActivity>(&engine, &id).await, success("activity:x"));
}

// ---------------------------------------------------------------------------------------
// User closures that panic before they return their future

workflow!(PanickyFinalizer, String, String);

/// A finalizer closure whose panic comes before its future exists.
fn panicking_finalizer(_: RunExit) -> std::future::Ready<()> {
    std::panic::panic_any("a finalizer that panics before returning its future")
}

/// A workflow finalizer that panics before it returns its future is caught like one that
/// panics while it runs: the other finalizers still run once and the execution ends.
pub(crate) async fn a_finalizer_panicking_before_its_future_ends_the_execution(h: &impl Harness) {
    let engine = h.engine().await;
    let log = Log::default();
    let run_log = log.clone();
    PanickyFinalizer::register(&engine, move |ctx: WorkflowContext, _: Input| {
        let log = run_log.clone();
        async move {
            let compensation_log = log.clone();
            ctx.activity("reserve", |_| async { Ok::<_, String>("held".to_owned()) })
                .compensate(move |_, _| async move { compensation_log.push("compensate") })
                .await?;
            ctx.add_finalizer(panicking_finalizer);
            Err::<String, _>("the order failed".to_owned())
        }
    })
    .unwrap();
    let result = tokio::time::timeout(
        ms(60_000),
        engine.execute::<PanickyFinalizer>(input("panicky-finalizer")),
    )
    .await
    .expect("execute never returned");
    assert!(matches!(&result, Err(ExecuteError::Failed(error)) if error == "the order failed"));
    // Time for restarts and replays, had the panic escaped.
    tokio::time::sleep(ms(5_000)).await;
    assert_eq!(log.count("compensate"), 1, "{:?}", log.entries());
}

const PANICKY_QUEUE: cluster_workflow::DurableQueue<Item, u64, String> =
    cluster_workflow::DurableQueue::new("PanickyQueue", |item: &Item| item.id.clone());

workflow!(PanickyWorker, u64, String);

/// A queue worker closure whose panic comes before its future exists.
fn panicking_worker(_: Item) -> std::future::Ready<Result<u64, String>> {
    std::panic::panic_any("a worker that panics before returning its future")
}

/// A queue worker that panics before it returns its future is a defect of its item, as one
/// that panics while it runs: the workflow gets the defect and ends.
pub(crate) async fn a_queue_worker_panicking_before_its_future_is_a_defect(h: &impl Harness) {
    let engine = h.engine().await;
    PanickyWorker::register(&engine, move |ctx: WorkflowContext, payload: Input| async move {
        PANICKY_QUEUE.process(&ctx, Item { id: "panics".into(), value: payload.value }).await
    })
    .unwrap();
    engine.register_queue_worker(PANICKY_QUEUE, panicking_worker, 1).unwrap();
    let id = engine.execute_discard::<PanickyWorker>(input("panicky-worker")).await.unwrap();
    let exit = complete_exit::<PanickyWorker>(&engine, &id).await;
    assert_eq!(kind(&exit), "die", "{exit:?}");
}

workflow!(PanickyDrop, String, String);

/// A body local whose `Drop` (a body finalizer) panics when its run suspends.
struct PanicOnSuspend(WorkflowContext);

impl Drop for PanicOnSuspend {
    fn drop(&mut self) {
        if self.0.is_suspended() {
            std::panic::panic_any("a body finalizer that panics at a suspension");
        }
    }
}

/// A body finalizer that panics when the run suspends does not stop the suspension from
/// being stored: the completion it waits for then finishes the execution.
pub(crate) async fn a_body_finalizer_panicking_at_a_suspension_lets_the_run_suspend(
    h: &impl Harness,
) {
    let engine = h.engine().await;
    PanickyDrop::register(&engine, |ctx: WorkflowContext, _: Input| async move {
        let _finalizer = PanicOnSuspend(ctx.clone());
        match ctx.await_deferred(&gate()).await {
            Ok(value) => Ok(value),
            Err(never) => match never {},
        }
    })
    .unwrap();
    let id = engine.execute_discard::<PanickyDrop>(input("panicky-drop")).await.unwrap();
    suspended::<PanickyDrop>(&engine, &id).await;
    open::<PanickyDrop>(&engine, &id, &gate(), "opened").await;
    assert_eq!(complete_exit::<PanickyDrop>(&engine, &id).await, success("opened"));
}

// ---------------------------------------------------------------------------------------
// Names the engine keeps for its own records

workflow!(ReservedNames, String, String);

/// A deferred named like a race's record (`raceAll/<race>`) is refused where it is defined, so
/// that no completion of it can decide `ctx.race("x")` without running a branch (before the
/// check, a completion of `raceAll/x` was the race's winner); an activity named like a short
/// sleep (`DurableClock/<clock>`) ends the run with a defect that names the reserved prefix.
pub(crate) async fn reserved_names_are_refused(h: &impl Harness) {
    for name in ["raceAll/x", "DurableClock/nap", "DurableQueue/q/1", "Workflow/InterruptSignal"] {
        let refused = DurableDeferred::<String>::new(name).unwrap_err();
        assert_eq!(refused.name, name);
    }
    let engine = h.engine().await;
    let log = Log::default();
    let run_log = log.clone();
    ReservedNames::register(&engine, move |ctx: WorkflowContext, payload: Input| {
        let log = run_log.clone();
        async move {
            let call = ctx.activity("DurableClock/nap", move |_| {
                let log = log.clone();
                async move {
                    log.push("activity ran");
                    Ok::<_, String>("slept".to_owned())
                }
            });
            if payload.to == "caught" {
                return match call.catch_defects().await {
                    Err(ActivityError::Defect(defect)) => Ok(defect),
                    other => Ok(format!("not refused: {other:?}")),
                };
            }
            call.await
        }
    })
    .unwrap();
    let caught = engine.execute::<ReservedNames>(input_to("caught", "caught")).await.unwrap();
    assert!(caught.contains("DurableClock/") && caught.contains("choose a name"), "{caught}");
    let died = engine.execute::<ReservedNames>(input("died")).await;
    assert!(
        matches!(&died, Err(ExecuteError::Defect(defect)) if defect.contains("keeps for its own records")),
        "{died:?}"
    );
    assert!(log.entries().is_empty(), "a refused activity ran: {:?}", log.entries());
}

// ---------------------------------------------------------------------------------------
// Values over the storage's limit

workflow!(Oversized, String, String);

/// A string whose JSON is over `limit` bytes.
fn oversized(limit: usize) -> String {
    "x".repeat(limit + 1)
}

/// Values over the storage's limit are typed errors, never a stuck execution: an activity's
/// result is a defect the body can catch (or that completes the execution), a workflow's
/// result is a defect for its caller, and a completion is refused to its completer. Before the
/// fix an activity result over MySQL's 64 KiB restarted the run without end.
pub(crate) async fn values_over_the_storage_limit_are_typed_errors(h: &impl Harness) {
    let Some(limit) = h.value_bytes_max() else { return };
    let engine = h.engine().await;
    Oversized::register(&engine, move |ctx: WorkflowContext, payload: Input| async move {
        match payload.to.as_str() {
            "caught" => {
                let caught = ctx
                    .activity("big", |_| async move { Ok::<_, String>(oversized(limit)) })
                    .catch_defects()
                    .await;
                match caught {
                    Err(ActivityError::Defect(defect)) => Ok(format!("caught {defect}")),
                    Err(ActivityError::Failed(error)) => Err(error),
                    Ok(value) => Ok(format!("stored {} bytes", value.len())),
                }
            }
            "transactional" => {
                let caught = ctx
                    .activity("big", |_| async move { Ok::<_, String>(oversized(limit)) })
                    .with_transaction()
                    .catch_defects()
                    .await;
                match caught {
                    Err(ActivityError::Defect(defect)) => Ok(format!("caught {defect}")),
                    Err(ActivityError::Failed(error)) => Err(error),
                    Ok(value) => Ok(format!("stored {} bytes", value.len())),
                }
            }
            "uncaught" => ctx.activity("big", |_| async move { Ok(oversized(limit)) }).await,
            "result" => Ok(oversized(limit)),
            _ => {
                let gate = DurableDeferred::<String>::new("Big").unwrap();
                ctx.await_deferred(&gate).await.map_err(|never| match never {})
            }
        }
    })
    .unwrap();
    for to in ["caught", "transactional"] {
        let caught =
            tokio::time::timeout(ms(120_000), engine.execute::<Oversized>(input_to(to, to)))
                .await
                .unwrap_or_else(|_| panic!("the {to} execution never ended"))
                .unwrap();
        assert!(
            caught.starts_with("caught") && caught.contains("ReplyNotStored"),
            "{to}: {caught}"
        );
    }
    for to in ["uncaught", "result"] {
        let died = tokio::time::timeout(ms(120_000), engine.execute::<Oversized>(input_to(to, to)))
            .await
            .unwrap_or_else(|_| panic!("the {to} execution never ended"));
        assert!(
            matches!(&died, Err(ExecuteError::Defect(defect)) if defect.contains("ReplyNotStored")),
            "{to}: {died:?}"
        );
    }
    let id = engine.execute_discard::<Oversized>(input_to("waits", "gate")).await.unwrap();
    suspended::<Oversized>(&engine, &id).await;
    let token = DurableDeferred::<String>::new("Big").unwrap().token_for::<Oversized>(&id);
    let refused = engine.complete(&token, Ok::<String, Never>(oversized(limit))).await;
    assert!(refused.is_err(), "an oversized completion was accepted");
    open::<Oversized>(&engine, &id, &DurableDeferred::new("Big").unwrap(), "small").await;
    assert_eq!(complete_exit::<Oversized>(&engine, &id).await, success("small"));
}

// ---------------------------------------------------------------------------------------
// Tokens are names, not rights

/// A completion for an execution that was never started is refused (its id and its tokens are
/// computable from public inputs), so it cannot decide a later execution's step; nor can a
/// token reach the engine's own records, such as the interrupt signal. Before the fix the
/// early completion was the later execution's result, and the forged signal interrupted it.
pub(crate) async fn tokens_cannot_complete_ahead_of_an_execution_or_the_engines_records(
    h: &impl Harness,
) {
    workflow!(Gatekept, String, String);
    let engine = h.engine().await;
    Gatekept::register(&engine, |ctx: WorkflowContext, _: Input| async move {
        ctx.await_deferred(&gate()).await.map_err(|never| match never {})
    })
    .unwrap();
    let id = Gatekept::execution_id(&input("victim"));
    let early = engine.complete(&gate().token_for::<Gatekept>(&id), Ok::<_, Never>("forged")).await;
    assert!(matches!(&early, Err(WorkflowError::NoSuchExecution { .. })), "{early:?}");
    let started = engine.execute_discard::<Gatekept>(input("victim")).await.unwrap();
    assert_eq!(started, id);
    suspended::<Gatekept>(&engine, &id).await;
    let signal = cluster_workflow::Token {
        workflow: Gatekept::NAME.into(),
        execution_id: id.clone(),
        deferred: cluster_workflow::INTERRUPT_SIGNAL.into(),
    };
    let forged = engine.complete(&signal, Ok::<(), Never>(())).await;
    assert!(matches!(&forged, Err(WorkflowError::ReservedName(_))), "{forged:?}");
    // Still waiting for its own gate: neither the early value nor an interrupt reached it.
    tokio::time::sleep(ms(1_000)).await;
    suspended::<Gatekept>(&engine, &id).await;
    open::<Gatekept>(&engine, &id, &gate(), "genuine").await;
    assert_eq!(complete_exit::<Gatekept>(&engine, &id).await, success("genuine"));
}
