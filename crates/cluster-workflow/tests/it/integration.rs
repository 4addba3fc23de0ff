//! The reference's cluster integration tests (effect's workflow integration tests) on PostgreSQL
//! and MySQL: three runners in this process, each on a tokio runtime of its own with its own
//! database connections, so that one can be killed (its runtime dropped at once: no handoff, its
//! lock sessions end) or the whole cluster restarted. The durable queue cases also run on an SQLite
//! file.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_core::ids::RunnerAddress;
use cluster_core::queue_storage::{LOCK_EXPIRED_FAILURE, QueueItem, QueueItemState};
use cluster_sharding::Sharding;
use cluster_testkit::databases::TestDatabase;
use cluster_workflow::{
    ClusterOptions, DurableDeferred, ExecuteError, ExecutionId, Never, QueueOptions, Workflow,
    WorkflowContext, WorkflowEngine, WorkflowResult, activity_idempotency_key,
};
use serde::{Deserialize, Serialize};

/// How long a killed runner keeps its shards (lock expiration) in these tests.
const EXPIRATION: Duration = Duration::from_millis(1_750);

fn config(port: u16) -> ShardingConfig {
    ShardingConfig {
        runner_address: Some(RunnerAddress::new("127.0.0.1", port)),
        shards_per_group: 30,
        refresh_assignments_interval: Duration::from_millis(100),
        shard_lock_refresh_interval: Duration::from_millis(500),
        shard_lock_expiration: EXPIRATION,
        entity_message_poll_interval: Duration::from_millis(100),
        entity_reply_poll_interval: Duration::from_millis(100),
        entity_termination_timeout: Duration::from_millis(500),
        ..ShardingConfig::default()
    }
}

/// What every runner's bodies record, shared across the process.
#[derive(Clone, Default)]
struct Probe {
    counts: Arc<Mutex<BTreeMap<String, u32>>>,
    /// The runner that ran an activity last, by activity name.
    ran_on: Arc<Mutex<BTreeMap<String, u16>>>,
}

impl Probe {
    fn hit(&self, what: &str) {
        *self.counts.lock().unwrap().entry(what.to_owned()).or_default() += 1;
    }

    fn count(&self, what: &str) -> u32 {
        self.counts.lock().unwrap().get(what).copied().unwrap_or(0)
    }

    fn ran(&self, activity: &str, port: u16) {
        self.ran_on.lock().unwrap().insert(activity.to_owned(), port);
    }

    fn owner(&self, activity: &str) -> Option<u16> {
        self.ran_on.lock().unwrap().get(activity).copied()
    }
}

/// One runner on a runtime of its own.
struct Node {
    port: u16,
    runtime: Option<tokio::runtime::Runtime>,
    sharding: Sharding,
    engine: WorkflowEngine,
}

impl Node {
    async fn start(database: &Arc<TestDatabase>, port: u16, probe: &Probe, workers: bool) -> Node {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (database, probe) = (Arc::clone(database), probe.clone());
        let started = runtime.spawn(async move {
            let config = config(port);
            let (messages, locks) = database.open(&config).await.unwrap();
            let queue_storage = Some(database.queue_storage().await.unwrap());
            let sharding = Sharding::member(config, messages, locks).start().await.unwrap();
            let options = ClusterOptions { queue_storage, queue: queue_options() };
            let engine = WorkflowEngine::cluster_with(&sharding, options).unwrap();
            register(&engine, &probe, port);
            if workers {
                register_worker(&engine, &probe, port);
            }
            (sharding, engine)
        });
        let (sharding, engine) = started.await.unwrap();
        Node { port, runtime: Some(runtime), sharding, engine }
    }

    /// The runner dies: its tasks are dropped where they are, nothing is handed off.
    fn kill(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }

    /// A graceful stop (the shards are handed off, the queue items released).
    async fn stop(mut self) {
        let (sharding, engine) = (self.sharding.clone(), self.engine.clone());
        if let Some(runtime) = self.runtime.take() {
            let stopped = runtime.spawn(async move {
                engine.shutdown().await;
                sharding.shutdown().await;
            });
            let _ = stopped.await;
            runtime.shutdown_background();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Three runners on one database.
struct Cluster {
    database: Arc<TestDatabase>,
    probe: Probe,
    nodes: Vec<Node>,
    next_port: u16,
}

impl Cluster {
    async fn start(database: TestDatabase) -> Cluster {
        Cluster::start_with(database, true).await
    }

    /// Three runners, with or without the queue's worker.
    async fn start_with(database: TestDatabase, workers: bool) -> Cluster {
        let mut cluster = Cluster::empty(database);
        cluster.add_nodes(3, workers).await;
        cluster
    }

    /// No runner yet.
    fn empty(database: TestDatabase) -> Cluster {
        Cluster {
            database: Arc::new(database),
            probe: Probe::default(),
            nodes: Vec::new(),
            next_port: 1,
        }
    }

    async fn add(&mut self, count: u16) {
        self.add_nodes(count, true).await;
    }

    /// Adds runners, with or without the queue's worker.
    async fn add_nodes(&mut self, count: u16, workers: bool) {
        for _ in 0..count {
            let node = Node::start(&self.database, self.next_port, &self.probe, workers).await;
            self.next_port += 1;
            self.nodes.push(node);
        }
    }

    fn engine(&self, index: usize) -> WorkflowEngine {
        self.nodes[index].engine.clone()
    }

    /// Kills the runner that ran `activity`; returns its port.
    fn kill_owner_of(&mut self, activity: &str) -> u16 {
        let port = self.probe.owner(activity).expect("the activity ran");
        let index = self.nodes.iter().position(|node| node.port == port).expect("the owner runs");
        self.nodes.remove(index).kill();
        port
    }

    /// Kills every runner and starts three new ones.
    async fn restart(&mut self) {
        for node in self.nodes.drain(..) {
            node.kill();
        }
        self.add(3).await;
    }

    async fn finish(mut self) {
        for node in self.nodes.drain(..) {
            node.stop().await;
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Input {
    key: String,
    #[serde(default)]
    to: String,
}

fn input(key: &str, to: &str) -> Input {
    Input { key: key.to_owned(), to: to.to_owned() }
}

#[derive(Debug, Serialize, Deserialize)]
struct RetryError {
    attempt: u32,
}

macro_rules! workflow {
    ($name:ident, $success:ty, $error:ty) => {
        struct $name;
        impl Workflow for $name {
            const NAME: &'static str = concat!("It", stringify!($name));
            type Payload = Input;
            type Success = $success;
            type Error = $error;
            fn idempotency_key(payload: &Input) -> String {
                payload.key.clone()
            }
        }
    };
}

workflow!(EndToEnd, u32, Never);
workflow!(Resumable, String, Never);
workflow!(Compensated, String, String);
workflow!(Retried, u32, RetryError);
workflow!(Clocked, u64, Never);
workflow!(Interruptible, String, Never);
workflow!(Raced, String, String);
workflow!(QueueUser, String, Never);

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    id: String,
}

const JOBS: cluster_workflow::DurableQueue<Job, String, Never> =
    cluster_workflow::DurableQueue::new("ItJobs", |job: &Job| job.id.clone());

/// How the runners' queue workers work in these tests: claims lapse within seconds, and an
/// item gets two attempts.
fn queue_options() -> QueueOptions {
    QueueOptions {
        poll_interval: Duration::from_millis(200),
        lock_refresh_interval: Duration::from_millis(500),
        lock_expiration: Duration::from_secs(2),
        max_attempts: std::num::NonZeroU32::new(2).unwrap(),
        ..QueueOptions::default()
    }
}

/// The queue's worker: records each item it starts (`job-start:<id>`, and where, as
/// `job:<id>`) and finishes (`job`). Items `hang-once` (on its first attempt) and `doomed`
/// (always) never finish, until their runner dies.
fn register_worker(engine: &WorkflowEngine, probe: &Probe, port: u16) {
    let p = probe.clone();
    engine
        .register_queue_worker(
            JOBS,
            move |job: Job| {
                let p = p.clone();
                async move {
                    p.hit(&format!("job-start:{}", job.id));
                    p.ran(&format!("job:{}", job.id), port);
                    let first = p.count(&format!("job-start:{}", job.id)) == 1;
                    if job.id == "doomed" || (job.id == "hang-once" && first) {
                        std::future::pending::<()>().await;
                    }
                    p.hit("job");
                    Ok(format!("processed:{}", job.id))
                }
            },
            4,
        )
        .unwrap();
}

fn gate(name: &str) -> DurableDeferred<String> {
    DurableDeferred::new(name).unwrap()
}

/// Registers every workflow of these tests on a runner.
fn register(engine: &WorkflowEngine, probe: &Probe, port: u16) {
    let p = probe.clone();
    EndToEnd::register(engine, move |ctx: WorkflowContext, _: Input| {
        let p = p.clone();
        async move {
            ctx.activity("gated", move |_| {
                let p = p.clone();
                async move {
                    p.hit("gated");
                    // Both callers are attached before the activity ends.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    Ok::<u32, Never>(42)
                }
            })
            .await
        }
    })
    .unwrap();
    let p = probe.clone();
    Resumable::register(engine, move |ctx: WorkflowContext, _: Input| {
        let p = p.clone();
        async move {
            p.ran("run", port);
            ctx.activity("BeforeSuspension", move |_| {
                let p = p.clone();
                async move {
                    p.hit("BeforeSuspension");
                    p.ran("BeforeSuspension", port);
                    Ok::<(), Never>(())
                }
            })
            .await?;
            ctx.await_deferred(&gate("Gate")).await
        }
    })
    .unwrap();
    register_waiting(engine, probe, port);
}

/// The workflows of these tests that wait for a deferred or a race.
fn register_waiting(engine: &WorkflowEngine, probe: &Probe, port: u16) {
    let p = probe.clone();
    Compensated::register(engine, move |ctx: WorkflowContext, _: Input| {
        let p = p.clone();
        async move {
            p.ran("run", port);
            let (step, undo) = (p.clone(), p.clone());
            ctx.activity("reserve", move |_| {
                let p = step.clone();
                async move {
                    p.ran("reserve", port);
                    Ok::<_, String>("held".to_owned())
                }
            })
            .compensate(move |_, _| async move { undo.hit("compensation") })
            .await?;
            let value =
                ctx.await_deferred(&gate("Gate")).await.unwrap_or_else(|never| match never {});
            if value == "fail" { Err("compensated".to_owned()) } else { Ok(value) }
        }
    })
    .unwrap();
    let p = probe.clone();
    Retried::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let p = p.clone();
        async move {
            ctx.activity("retried", move |activity| {
                let (p, succeed) = (p.clone(), payload.to == "succeed");
                async move {
                    let attempt = activity.attempt();
                    p.hit(&format!("{}:attempt:{attempt}", if succeed { "s" } else { "f" }));
                    if succeed && attempt == 3 { Ok(attempt) } else { Err(RetryError { attempt }) }
                }
            })
            .retry(2)
            .await
        }
    })
    .unwrap();
    Clocked::register(engine, move |ctx: WorkflowContext, _: Input| async move {
        ctx.sleep_with_threshold("nap", Duration::from_secs(1), Duration::ZERO).await;
        Ok(0)
    })
    .unwrap();
    let p = probe.clone();
    Interruptible::register(engine, move |ctx: WorkflowContext, _: Input| {
        let p = p.clone();
        async move {
            p.hit("interruptible:run");
            ctx.await_deferred(&gate("Gate")).await
        }
    })
    .unwrap();
    register_race(engine, probe, port);
    let p = probe.clone();
    QueueUser::register(engine, move |ctx: WorkflowContext, payload: Input| {
        let p = p.clone();
        async move {
            p.hit(&format!("queue-user:{}", payload.key));
            JOBS.process(&ctx, Job { id: payload.key }).await
        }
    })
    .unwrap();
}

/// The race of integration test 4.
fn register_race(engine: &WorkflowEngine, probe: &Probe, port: u16) {
    let p = probe.clone();
    Raced::register(engine, move |ctx: WorkflowContext, _: Input| {
        let p = p.clone();
        async move {
            p.ran("run", port);
            let (a, b) = (p.clone(), p.clone());
            let winner = ctx
                .race(
                    "race",
                    vec![
                        Box::pin(
                            ctx.activity("winner", move |_| {
                                let p = a.clone();
                                async move {
                                    p.hit("branch:winner");
                                    p.ran("winner", port);
                                    Ok::<_, String>("winner".to_owned())
                                }
                            })
                            .into_future(),
                        ),
                        Box::pin(
                            ctx.activity("loser", move |_| {
                                let p = b.clone();
                                async move {
                                    p.hit("branch:loser");
                                    tokio::time::sleep(Duration::from_secs(30)).await;
                                    Ok::<_, String>("loser".to_owned())
                                }
                            })
                            .into_future(),
                        ),
                    ],
                )
                .await?;
            let tail =
                ctx.await_deferred(&gate("Tail")).await.unwrap_or_else(|never| match never {});
            Ok(format!("{winner}:{tail}"))
        }
    })
    .unwrap();
}

use std::future::IntoFuture;

/// Polls (from `engine`) until the execution completes.
async fn complete<W: Workflow>(engine: &WorkflowEngine, id: &ExecutionId) -> cluster_core::Exit {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(WorkflowResult::Complete(exit))) = engine.poll::<W>(id).await {
            return exit;
        }
        assert!(tokio::time::Instant::now() < deadline, "{} did not complete", W::NAME);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn suspended<W: Workflow>(engine: &WorkflowEngine, id: &ExecutionId) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(WorkflowResult::Suspended { .. })) = engine.poll::<W>(id).await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{} did not suspend", W::NAME);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn success<T: Serialize>(value: T) -> cluster_core::Exit {
    cluster_core::Exit::Success(cluster_core::RawJson::encode(&value).unwrap())
}

async fn open<W: Workflow>(engine: &WorkflowEngine, id: &ExecutionId, name: &str, value: &str) {
    let token = gate(name).token_for::<W>(id);
    engine.complete(&token, Ok::<String, Never>(value.to_owned())).await.unwrap();
}

/// #1: two callers on two runners share one execution; the activity runs once.
async fn executes_end_to_end_and_deduplicates_concurrent_callers(database: TestDatabase) {
    let cluster = Cluster::start(database).await;
    let (first, second) = (cluster.engine(0), cluster.engine(1));
    let a = tokio::spawn(async move { first.execute::<EndToEnd>(input("e2e", "")).await.unwrap() });
    let b =
        tokio::spawn(async move { second.execute::<EndToEnd>(input("e2e", "")).await.unwrap() });
    assert_eq!(a.await.unwrap(), 42);
    assert_eq!(b.await.unwrap(), 42);
    assert_eq!(cluster.probe.count("gated"), 1);
    cluster.finish().await;
}

/// #2: the owner dies while the execution waits; a completion from a surviving runner
/// resumes it elsewhere and the completed activity does not run again.
async fn replays_completed_activities_after_the_owner_dies(database: TestDatabase) {
    let mut cluster = Cluster::start(database).await;
    let id = cluster.engine(0).execute_discard::<Resumable>(input("owner-dies", "")).await.unwrap();
    suspended::<Resumable>(&cluster.engine(0), &id).await;
    let dead = cluster.kill_owner_of("BeforeSuspension");
    let engine = cluster.engine(0);
    open::<Resumable>(&engine, &id, "Gate", "resumed").await;
    assert_eq!(complete::<Resumable>(&engine, &id).await, success("resumed"));
    assert_eq!(cluster.probe.count("BeforeSuspension"), 1, "the completed activity ran once");
    assert_ne!(cluster.probe.owner("run"), Some(dead), "the replay ran on another runner");
    cluster.finish().await;
}

/// #3: the whole cluster restarts while the execution waits; a runner of the new cluster
/// completes the deferred.
async fn resumes_a_deferred_across_a_whole_cluster_restart(database: TestDatabase) {
    let mut cluster = Cluster::start(database).await;
    let id = cluster.engine(1).execute_discard::<Resumable>(input("restart", "")).await.unwrap();
    suspended::<Resumable>(&cluster.engine(1), &id).await;
    cluster.restart().await;
    let engine = cluster.engine(2);
    open::<Resumable>(&engine, &id, "Gate", "after-restart").await;
    assert_eq!(complete::<Resumable>(&engine, &id).await, success("after-restart"));
    assert_eq!(cluster.probe.count("BeforeSuspension"), 1);
    cluster.finish().await;
}

/// #5: the owner is lost while the execution waits; the replay on the new owner fails, and the
/// compensation runs exactly once.
async fn compensates_once_after_the_owner_is_lost(database: TestDatabase) {
    let mut cluster = Cluster::start(database).await;
    let id =
        cluster.engine(0).execute_discard::<Compensated>(input("compensate", "")).await.unwrap();
    suspended::<Compensated>(&cluster.engine(0), &id).await;
    let dead = cluster.kill_owner_of("reserve");
    let engine = cluster.engine(0);
    open::<Compensated>(&engine, &id, "Gate", "fail").await;
    let exit = complete::<Compensated>(&engine, &id).await;
    assert_eq!(
        exit,
        cluster_core::Exit::fail(cluster_core::RawJson::encode("compensated").unwrap())
    );
    // The compensation runs in the run that produced the failure, before its reply is stored.
    assert_eq!(cluster.probe.count("compensation"), 1);
    assert_ne!(cluster.probe.owner("run"), Some(dead), "the replay ran on another runner");
    cluster.finish().await;
}

/// #7: attempts 1, 2, 3; the exhausted error is the last attempt's.
async fn applies_the_activity_retry_policy(database: TestDatabase) {
    let cluster = Cluster::start(database).await;
    let engine = cluster.engine(1);
    assert_eq!(engine.execute::<Retried>(input("retry-s", "succeed")).await.unwrap(), 3);
    let failed = engine.execute::<Retried>(input("retry-f", "fail")).await;
    assert!(matches!(failed, Err(ExecuteError::Failed(RetryError { attempt: 3 }))), "{failed:?}");
    for attempt in 1..=3 {
        assert_eq!(cluster.probe.count(&format!("s:attempt:{attempt}")), 1);
        assert_eq!(cluster.probe.count(&format!("f:attempt:{attempt}")), 1);
    }
    cluster.finish().await;
}

/// #8: a durable clock scheduled before a whole-cluster restart wakes the execution after it.
async fn wakes_a_durable_clock_after_a_whole_cluster_restart(database: TestDatabase) {
    let mut cluster = Cluster::start(database).await;
    let started = tokio::time::Instant::now();
    let id = cluster.engine(0).execute_discard::<Clocked>(input("clock", "")).await.unwrap();
    suspended::<Clocked>(&cluster.engine(0), &id).await;
    cluster.restart().await;
    let engine = cluster.engine(0);
    assert_eq!(complete::<Clocked>(&engine, &id).await, success(0));
    assert!(started.elapsed() >= Duration::from_millis(900), "{:?}", started.elapsed());
    cluster.finish().await;
}

/// #10: an interrupt stored while suspended is applied after a whole-cluster restart.
async fn persists_an_interrupt_across_a_whole_cluster_restart(database: TestDatabase) {
    let mut cluster = Cluster::start(database).await;
    let id =
        cluster.engine(0).execute_discard::<Interruptible>(input("interrupt", "")).await.unwrap();
    suspended::<Interruptible>(&cluster.engine(0), &id).await;
    cluster.restart().await;
    let engine = cluster.engine(1);
    engine.interrupt::<Interruptible>(&id).await.unwrap();
    cluster.restart().await;
    let engine = cluster.engine(2);
    let exit = complete::<Interruptible>(&engine, &id).await;
    assert!(
        matches!(&exit, cluster_core::Exit::Failure(cause) if cause.has_interrupts()),
        "{exit:?}"
    );
    let caller = engine.execute::<Interruptible>(input("interrupt", "")).await;
    assert!(matches!(caller, Err(ExecuteError::Interrupted)), "{caller:?}");
    cluster.finish().await;
}

/// #4: the race's winner is recorded; after the owner's death the replay returns it without
/// entering a branch.
async fn replays_a_race_winner_after_owner_death(database: TestDatabase) {
    let mut cluster = Cluster::start(database).await;
    let id = cluster.engine(0).execute_discard::<Raced>(input("race", "")).await.unwrap();
    suspended::<Raced>(&cluster.engine(0), &id).await;
    let branches = (cluster.probe.count("branch:winner"), cluster.probe.count("branch:loser"));
    let dead = cluster.kill_owner_of("winner");
    let engine = cluster.engine(0);
    open::<Raced>(&engine, &id, "Tail", "after-owner-death").await;
    assert_eq!(complete::<Raced>(&engine, &id).await, success("winner:after-owner-death"));
    assert_eq!(
        (cluster.probe.count("branch:winner"), cluster.probe.count("branch:loser")),
        branches
    );
    assert_ne!(cluster.probe.owner("run"), Some(dead), "the replay ran on another runner");
    cluster.finish().await;
}

/// #9: an item offered while no runner has the queue's worker waits across a whole-cluster
/// restart and is consumed once by the new runners' workers.
async fn persists_queued_work_across_a_restart_and_consumes_it_once(database: TestDatabase) {
    let mut cluster = Cluster::start_with(database, false).await;
    let id = cluster.engine(0).execute_discard::<QueueUser>(input("job-1", "")).await.unwrap();
    suspended::<QueueUser>(&cluster.engine(0), &id).await;
    assert_eq!(cluster.probe.count("job"), 0);
    cluster.restart().await;
    let engine = cluster.engine(1);
    assert_eq!(complete::<QueueUser>(&engine, &id).await, success("processed:job-1"));
    assert_eq!(cluster.probe.count("job"), 1);
    cluster.finish().await;
}

/// Issue 21, item 12: of two runners only the first runs the queue's worker. Every item is
/// processed by it, whichever runner owns the shard its id hashes to; none is left to the
/// other runner (which stored a "not registered" defect for the items routed to it, so their
/// workflows waited forever).
async fn queue_items_go_only_to_runners_with_the_worker(database: TestDatabase) {
    let mut cluster = Cluster::empty(database);
    cluster.add_nodes(1, true).await;
    cluster.add_nodes(1, false).await;
    let engine = cluster.engine(1);
    let mut ids = Vec::new();
    for n in 0..8 {
        let key = format!("only-{n}");
        ids.push((engine.execute_discard::<QueueUser>(input(&key, "")).await.unwrap(), key));
    }
    for (id, key) in &ids {
        assert_eq!(complete::<QueueUser>(&engine, id).await, success(format!("processed:{key}")));
    }
    assert_eq!(cluster.probe.count("job"), 8, "each item ran once, on the worker's runner");
    cluster.finish().await;
}

/// The stored queue item of `QueueUser` execution `id` (key `key`).
async fn queue_item(database: &TestDatabase, id: &ExecutionId, key: &str) -> QueueItem {
    let item_id = activity_idempotency_key(id, &format!("DurableQueue/ItJobs/{key}"), None);
    let storage = database.queue_storage().await.unwrap();
    storage.item("DurableQueue/ItJobs", &item_id).await.unwrap().expect("the item is stored")
}

/// Waits until `probe` counted `what` `count` times.
async fn counted(probe: &Probe, what: &str, count: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while probe.count(what) < count {
        assert!(tokio::time::Instant::now() < deadline, "{what} did not reach {count}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 21, item 12: the runner whose worker runs an item dies; the item's claim lapses and
/// the other runner's worker runs it again, as its second attempt, and completes the workflow.
async fn a_queue_item_whose_worker_dies_is_processed_again(database: TestDatabase) {
    let mut cluster = Cluster::empty(database);
    cluster.add_nodes(2, true).await;
    let id = cluster.engine(0).execute_discard::<QueueUser>(input("hang-once", "")).await.unwrap();
    counted(&cluster.probe, "job-start:hang-once", 1).await;
    cluster.kill_owner_of("job:hang-once");
    let engine = cluster.engine(0);
    assert_eq!(complete::<QueueUser>(&engine, &id).await, success("processed:hang-once"));
    assert_eq!(cluster.probe.count("job-start:hang-once"), 2, "run again once");
    let item = queue_item(&cluster.database, &id, "hang-once").await;
    assert_eq!((item.state, item.attempts, item.claimed), (QueueItemState::Completed, 2, false));
    cluster.finish().await;
}

/// Issue 21, item 12: an item whose worker dies on every attempt is dead-lettered after the
/// last one (the reference's `PersistedQueue`: failed with "Lock expired after final
/// attempt"); its workflow stays suspended, and a replay's offer does not revive it.
async fn a_queue_item_is_dead_lettered_after_its_last_attempt(database: TestDatabase) {
    let mut cluster = Cluster::empty(database);
    cluster.add_nodes(3, true).await;
    let id = cluster.engine(0).execute_discard::<QueueUser>(input("doomed", "")).await.unwrap();
    for attempt in 1..=2 {
        counted(&cluster.probe, "job-start:doomed", attempt).await;
        cluster.kill_owner_of("job:doomed");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let item = loop {
        let item = queue_item(&cluster.database, &id, "doomed").await;
        if item.state == QueueItemState::Failed {
            break item;
        }
        assert!(tokio::time::Instant::now() < deadline, "the item was not failed: {item:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((item.attempts, item.claimed), (2, false));
    assert_eq!(item.last_failure.as_deref(), Some(LOCK_EXPIRED_FAILURE));
    let engine = cluster.engine(0);
    suspended::<QueueUser>(&engine, &id).await;
    // A replay offers the item again: it stays a dead letter, and no worker runs it.
    let runs = cluster.probe.count("queue-user:doomed");
    engine.resume::<QueueUser>(&id).await.unwrap();
    counted(&cluster.probe, "queue-user:doomed", runs + 1).await;
    suspended::<QueueUser>(&engine, &id).await;
    let item = queue_item(&cluster.database, &id, "doomed").await;
    assert_eq!((item.state, item.attempts), (QueueItemState::Failed, 2));
    assert_eq!(cluster.probe.count("job-start:doomed"), 2);
    cluster.finish().await;
}

/// The durable queue cases on one SQLite file too: several runners in one process share it as
/// processes would.
mod sqlite {
    macro_rules! on_sqlite {
        ($($name:ident),* $(,)?) => {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let database = cluster_testkit::databases::TestDatabase::sqlite("queue");
                    super::$name(database).await;
                }
            )*
        };
    }

    on_sqlite!(
        queue_items_go_only_to_runners_with_the_worker,
        a_queue_item_whose_worker_dies_is_processed_again,
        a_queue_item_is_dead_lettered_after_its_last_attempt,
    );
}

macro_rules! integration {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(database) = cluster_testkit::databases::TestDatabase::postgres() else { return };
                    super::$name(database).await;
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(database) = cluster_testkit::databases::TestDatabase::mysql() else { return };
                    super::$name(database).await;
                }
            )*
        }
    };
}

integration!(
    executes_end_to_end_and_deduplicates_concurrent_callers,
    replays_completed_activities_after_the_owner_dies,
    resumes_a_deferred_across_a_whole_cluster_restart,
    compensates_once_after_the_owner_is_lost,
    applies_the_activity_retry_policy,
    wakes_a_durable_clock_after_a_whole_cluster_restart,
    persists_an_interrupt_across_a_whole_cluster_restart,
    replays_a_race_winner_after_owner_death,
    persists_queued_work_across_a_restart_and_consumes_it_once,
    queue_items_go_only_to_runners_with_the_worker,
    a_queue_item_whose_worker_dies_is_processed_again,
    a_queue_item_is_dead_lettered_after_its_last_attempt,
);
