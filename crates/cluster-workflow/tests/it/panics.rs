//! Every user closure may panic, before it returns its future or while the future runs: the
//! activity body, the compensation, the workflow finalizer, the queue worker, and (on the
//! cluster engine) the handler and the factory of an entity an activity calls. A property
//! test draws which ones panic, how, and how often, and checks on both engines that every
//! execution ends with the outcome the panics imply, and that nothing runs again after its
//! outcome was stored (an activity, a queue item, a compensation, a finalizer, a handler that
//! answered).

use std::panic::panic_any;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::envelope::Exit;
use cluster_core::sync::lock;
use cluster_core::{Clock, Never};
use cluster_sharding::{
    Defects, Entity, EntityContext, EntityOptions, Handler, Protocol, RequestContext, Rpc, Sharding,
};
use cluster_testkit::memory::MemoryMessageStorage;
use cluster_workflow::{DurableQueue, Workflow, WorkflowContext, WorkflowEngine};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

use crate::cluster::{TokioClock, config, memory_queue};
use crate::suite::{self, Input};

/// How a closure panics: never, or on its first `n` calls, before it returns its future or
/// while the future runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Panic {
    Never,
    Before(u32),
    During(u32),
}

impl Panic {
    fn panics(self) -> bool {
        self != Panic::Never
    }
}

fn panic_plan() -> impl Strategy<Value = Panic> {
    prop_oneof![
        Just(Panic::Never),
        (1u32..=2).prop_map(Panic::Before),
        (1u32..=2).prop_map(Panic::During),
    ]
}

/// Which closures panic in one execution, and whether its body fails at the end.
#[derive(Clone, Copy, Debug)]
struct Plan {
    activity: Panic,
    compensation: Panic,
    finalizer: Panic,
    worker: Panic,
    handler: Panic,
    factory: Panic,
    fails: bool,
}

fn plan() -> impl Strategy<Value = Plan> {
    (
        panic_plan(),
        panic_plan(),
        panic_plan(),
        panic_plan(),
        panic_plan(),
        panic_plan(),
        any::<bool>(),
    )
        .prop_map(|(activity, compensation, finalizer, worker, handler, factory, fails)| {
            Plan { activity, compensation, finalizer, worker, handler, factory, fails }
        })
}

/// One closure's calls and completed futures; it panics as its plan says.
#[derive(Clone)]
struct Probe {
    name: &'static str,
    panic: Panic,
    calls: Arc<AtomicU32>,
    completions: Arc<AtomicU32>,
}

impl Probe {
    fn new(name: &'static str, panic: Panic) -> Probe {
        Probe { name, panic, calls: Arc::default(), completions: Arc::default() }
    }

    /// The closure is called: panics now under `Before`; returns whether its future panics.
    fn call(&self) -> bool {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        match self.panic {
            Panic::Before(n) if call <= n => {
                panic_any(format!("{} panics before its future", self.name))
            }
            Panic::During(n) => call <= n,
            _ => false,
        }
    }

    /// The closure's future ends (after a yield, so that a `During` panic comes from a later
    /// poll than the first).
    async fn finish(&self, panics: bool) {
        tokio::task::yield_now().await;
        if panics {
            panic_any(format!("{} panics while its future runs", self.name));
        }
        self.completions.fetch_add(1, Ordering::SeqCst);
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    fn completions(&self) -> u32 {
        self.completions.load(Ordering::SeqCst)
    }
}

/// Every probe of one execution.
#[derive(Clone)]
struct Probes {
    reserve: Probe,
    call: Probe,
    compensation: Probe,
    finalizer: Probe,
    worker: Probe,
    handler: Probe,
    factory: Probe,
    /// Per run of the body: how often that run's finalizer was called.
    finalizers_by_run: Arc<Mutex<Vec<u32>>>,
}

impl Probes {
    fn new(plan: Plan) -> Probes {
        Probes {
            reserve: Probe::new("reserve", Panic::Never),
            call: Probe::new("the activity", plan.activity),
            compensation: Probe::new("the compensation", plan.compensation),
            finalizer: Probe::new("the finalizer", plan.finalizer),
            worker: Probe::new("the queue worker", plan.worker),
            handler: Probe::new("the handler", plan.handler),
            factory: Probe::new("the factory", plan.factory),
            finalizers_by_run: Arc::default(),
        }
    }
}

/// An entity that an activity calls: its factory and its handler panic as planned.
struct Stamper {
    handler: Probe,
}

/// A persisted request with a primary key: answered once, however often it runs.
#[derive(Serialize, Deserialize)]
struct Stamp {
    key: String,
}

impl Rpc for Stamp {
    const TAG: &'static str = "Stamp";
    const PERSISTED: bool = true;
    type Success = u32;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl Entity for Stamper {
    const TYPE: &'static str = "Stamper";
    const FACTORY_ONLY: bool = true;

    fn create(_: &EntityContext) -> impl std::future::Future<Output = Stamper> + Send {
        std::future::pending()
    }

    fn protocol(protocol: &mut Protocol<Stamper>) {
        protocol.handle::<Stamp>();
    }
}

impl Handler<Stamp> for Stamper {
    fn handle(
        &mut self,
        _: &RequestContext,
        _: Stamp,
    ) -> impl std::future::Future<Output = Result<u32, Never>> + Send {
        let handler = self.handler.clone();
        let panics = handler.call();
        async move {
            handler.finish(panics).await;
            Ok(7)
        }
    }
}

struct Probed;

impl Workflow for Probed {
    const NAME: &'static str = "Probed";
    type Payload = Input;
    type Success = u64;
    type Error = String;

    fn idempotency_key(payload: &Input) -> String {
        payload.key.clone()
    }
}

const ITEMS: DurableQueue<u64, u64, String> =
    DurableQueue::new("ProbedItems", |n: &u64| n.to_string());

/// Registers the workflow (and, with `sharding`, the entity) with the closures of `probes`.
fn register(engine: &WorkflowEngine, sharding: Option<&Sharding>, probes: &Probes, fails: bool) {
    if let Some(sharding) = sharding {
        let (factory, handler) = (probes.factory.clone(), probes.handler.clone());
        // A panicking handler runs its request again (the reference's fatal defects): the
        // property below counts those runs.
        let options = EntityOptions { defects: Some(Defects::Replay), ..EntityOptions::default() };
        let made = sharding
            .entity::<Stamper>()
            .options(options)
            .factory(move |_| {
                // The factory is synchronous: either panic mode panics in the call.
                let panics = factory.call();
                if panics {
                    panic_any("the factory panics");
                }
                factory.completions.fetch_add(1, Ordering::SeqCst);
                Stamper { handler: handler.clone() }
            })
            .register();
        made.unwrap();
    }
    let worker = probes.worker.clone();
    engine
        .register_queue_worker(
            ITEMS,
            move |n: u64| {
                let worker = worker.clone();
                let panics = worker.call();
                async move {
                    worker.finish(panics).await;
                    Ok::<u64, String>(n + 1)
                }
            },
            1,
        )
        .unwrap();
    let (probes, sharding) = (probes.clone(), sharding.cloned());
    let runs = Arc::new(AtomicU32::new(0));
    Probed::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let (probes, sharding) = (probes.clone(), sharding.clone());
        let run = runs.fetch_add(1, Ordering::SeqCst);
        async move {
            let (reserve, undo) = (probes.reserve.clone(), probes.compensation.clone());
            ctx.activity("reserve", move |_| {
                let reserve = reserve.clone();
                let panics = reserve.call();
                async move {
                    reserve.finish(panics).await;
                    Ok::<u64, String>(1)
                }
            })
            .compensate(move |_, _| {
                let panics = undo.call();
                async move { undo.finish(panics).await }
            })
            .await?;
            lock(&probes.finalizers_by_run).push(0);
            let (finalizer, by_run) =
                (probes.finalizer.clone(), Arc::clone(&probes.finalizers_by_run));
            let index = usize::try_from(run).unwrap_or(usize::MAX);
            ctx.add_finalizer(move |_| {
                if let Some(calls) = lock(&by_run).get_mut(index) {
                    *calls += 1;
                }
                let panics = finalizer.call();
                async move { finalizer.finish(panics).await }
            });
            let (call, key) = (probes.call.clone(), payload.key.clone());
            let called = ctx
                .activity("call", move |_| {
                    let (call, sharding, key) = (call.clone(), sharding.clone(), key.clone());
                    let panics = call.call();
                    async move {
                        if let Some(sharding) = sharding {
                            let stamper = sharding.client::<Stamper>("stamper");
                            stamper.send(Stamp { key }).await.map_err(|error| error.to_string())?;
                        }
                        call.finish(panics).await;
                        Ok::<u64, String>(2)
                    }
                })
                .catch_defects()
                .await
                .unwrap_or(0);
            let item = ITEMS.process(&ctx, called).await?;
            if fails {
                return Err("the order failed".to_owned());
            }
            Ok(item)
        }
    })
    .unwrap();
}

/// Runs one execution of `plan` on a fresh engine (the cluster engine on memory storage, or
/// the in-memory engine) and checks what ran.
async fn check(plan: Plan, cluster: bool) -> Result<(), TestCaseError> {
    let probes = Probes::new(plan);
    let (engine, sharding) = if cluster {
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let storage = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
        let sharding = Sharding::standalone(config(), storage)
            .clock(Arc::clone(&clock))
            .start()
            .await
            .unwrap();
        (WorkflowEngine::cluster_with(&sharding, memory_queue(clock)).unwrap(), Some(sharding))
    } else {
        (WorkflowEngine::memory(), None)
    };
    register(&engine, sharding.as_ref(), &probes, plan.fails);
    let id = engine.execute_discard::<Probed>(Input { key: "probed".into(), ..Input::default() });
    let id = id.await.unwrap();
    let ended = tokio::time::timeout(
        Duration::from_secs(600),
        suite::complete_exit::<Probed>(&engine, &id),
    )
    .await;
    let Ok(exit) = ended else {
        return Err(TestCaseError::fail(format!("{plan:?}: the execution never ended")));
    };
    // The queue worker's panic is the item's defect, which the body re-raises.
    let expected = if plan.worker.panics() {
        "die"
    } else if plan.fails {
        "fail"
    } else {
        "success"
    };
    let kind = match &exit {
        Exit::Success(_) => "success",
        Exit::Failure(cause)
            if cause
                .0
                .iter()
                .any(|r| matches!(r, cluster_core::envelope::CauseReason::Fail(_))) =>
        {
            "fail"
        }
        Exit::Failure(_) => "die",
    };
    prop_assert_eq!(kind, expected, "{:?}: {:?}", plan, exit);
    // Ran once each: a panic is the stored outcome of its step.
    prop_assert_eq!(probes.reserve.calls(), 1, "{:?}", plan);
    prop_assert_eq!(probes.call.calls(), 1, "{:?}: the activity ran again", plan);
    prop_assert_eq!(probes.worker.calls(), 1, "{:?}: the queue item ran again", plan);
    let compensations = u32::from(expected != "success");
    prop_assert_eq!(probes.compensation.calls(), compensations, "{:?}: compensations", plan);
    let by_run = lock(&probes.finalizers_by_run).clone();
    prop_assert!(
        by_run.iter().all(|calls| *calls == 1),
        "{:?}: finalizers by run {:?}",
        plan,
        by_run
    );
    if cluster {
        // The handler runs again only after a panic (no answer stored), and answers once.
        let reached = !matches!(plan.activity, Panic::Before(_));
        let handler_panics = match plan.handler {
            Panic::Never => 0,
            Panic::Before(n) | Panic::During(n) => n,
        };
        let (calls, answers) = (probes.handler.calls(), probes.handler.completions());
        if reached {
            prop_assert_eq!(answers, 1, "{:?}: the handler answered {} times", plan, answers);
            prop_assert_eq!(calls, handler_panics + 1, "{:?}: handler calls", plan);
        } else {
            prop_assert_eq!(calls, 0, "{:?}: the entity was called", plan);
        }
    }
    engine.shutdown().await;
    if let Some(sharding) = sharding {
        sharding.shutdown().await;
    }
    Ok(())
}

/// Runs `check` on a fresh single-threaded runtime with paused time.
fn run(plan: Plan, cluster: bool) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(check(plan, cluster))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// On the cluster engine (with an entity whose factory and handler may panic).
    #[test]
    fn panicking_closures_never_run_twice_and_every_execution_ends_on_the_cluster(plan in plan()) {
        run(plan, true)?;
    }

    /// On the in-memory engine.
    #[test]
    fn panicking_closures_never_run_twice_and_every_execution_ends_in_memory(plan in plan()) {
        run(plan, false)?;
    }
}
