//! Durable queues on the cluster engine, on in-memory storages with tokio's paused clock: what
//! the workers do with items they cannot run, results they cannot record, a stop and a panic,
//! and that only an engine with a queue storage takes part. The multi-runner cases (a worker
//! on one runner only, a worker that dies, the dead letter after the last attempt) are in
//! `integration`, on PostgreSQL and MySQL.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::envelope::CauseReason;
use cluster_core::queue_storage::{QueueItem, QueueItemState, QueueStorage};
use cluster_core::storage::MessageStorage;
use cluster_core::{Clock, Exit, RawJson};
use cluster_sharding::Sharding;
use cluster_testkit::faulty::{Faults, FaultyMessageStorage};
use cluster_testkit::memory::{MemoryMessageStorage, MemoryQueueStorage};
use cluster_testkit::wait::eventually;
use cluster_workflow::{
    ClusterOptions, DurableQueue, ExecutionId, Token, Workflow, WorkflowContext, WorkflowEngine,
    WorkflowError, activity_idempotency_key,
};
use serde::{Deserialize, Serialize};

use crate::cluster::{TokioClock, config};
use crate::suite::{self, Input};

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    id: String,
}

const JOBS: DurableQueue<Job, String, String> =
    DurableQueue::new("Jobs", |job: &Job| job.id.clone());

struct Jobber;
impl Workflow for Jobber {
    const NAME: &'static str = "Jobber";
    type Payload = Input;
    type Success = String;
    type Error = String;
    fn idempotency_key(payload: &Input) -> String {
        payload.key.clone()
    }
}

/// One runner with every shard on in-memory storages, whose message faults the test controls.
struct Runner {
    clock: Arc<dyn Clock>,
    messages: Arc<dyn MessageStorage>,
    faults: Arc<Faults>,
    queue: Arc<MemoryQueueStorage>,
    sharding: Sharding,
    engine: WorkflowEngine,
}

impl Runner {
    async fn start() -> Runner {
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let messages: Arc<dyn MessageStorage> =
            Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
        let (faulty, faults) = FaultyMessageStorage::new(Arc::clone(&messages));
        let queue = Arc::new(MemoryQueueStorage::new(Arc::clone(&clock)));
        let sharding = Sharding::standalone(config(), Arc::new(faulty))
            .clock(Arc::clone(&clock))
            .start()
            .await
            .unwrap();
        let engine = WorkflowEngine::cluster_with(&sharding, options(&queue)).unwrap();
        Jobber::register(&engine, |ctx: WorkflowContext, payload: Input| async move {
            JOBS.process(&ctx, Job { id: payload.key }).await
        })
        .unwrap();
        Runner { clock, messages, faults, queue, sharding, engine }
    }

    /// Another process on the same storages, serving no shard.
    async fn client(&self) -> (Sharding, WorkflowEngine) {
        let client_config = cluster_core::ShardingConfig { runner_address: None, ..config() };
        let sharding = Sharding::client_only(client_config, Arc::clone(&self.messages))
            .clock(Arc::clone(&self.clock))
            .start()
            .await
            .unwrap();
        let engine = WorkflowEngine::cluster_with(&sharding, options(&self.queue)).unwrap();
        (sharding, engine)
    }

    async fn item(&self, id: &ExecutionId, key: &str) -> QueueItem {
        let item_id = activity_idempotency_key(id, &format!("DurableQueue/Jobs/{key}"), None);
        let item = self.queue.item("DurableQueue/Jobs", &item_id).await.unwrap();
        item.expect("the item is stored")
    }
}

fn options(queue: &Arc<MemoryQueueStorage>) -> ClusterOptions {
    let queue_storage: Arc<dyn QueueStorage> = Arc::clone(queue) as Arc<dyn QueueStorage>;
    ClusterOptions { queue_storage: Some(queue_storage), ..ClusterOptions::default() }
}

fn input(key: &str) -> Input {
    Input { key: key.to_owned(), ..Input::default() }
}

/// Registers a worker that counts its runs and answers `done:<id>`.
fn register_counting_worker(engine: &WorkflowEngine, runs: &Arc<AtomicU32>) {
    let runs = Arc::clone(runs);
    engine
        .register_queue_worker(
            JOBS,
            move |job: Job| {
                let runs = Arc::clone(&runs);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, String>(format!("done:{}", job.id))
                }
            },
            2,
        )
        .unwrap();
}

/// Waits (on the paused clock) until the stored item is in `state`.
async fn item_in(runner: &Runner, queue_item: (&str, &str), state: QueueItemState) -> QueueItem {
    let (queue, id) = queue_item;
    for _ in 0..6_000 {
        if let Some(item) = runner.queue.item(queue, id).await.unwrap()
            && item.state == state
        {
            return item;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("item {id} did not become {state} within a minute");
}

/// Rows a worker can never run (not JSON, a token that cannot be read, a payload of the wrong
/// shape) are dead-lettered with the reason, once each, and the items after them run.
#[tokio::test(start_paused = true)]
async fn items_that_cannot_be_decoded_are_dead_lettered_and_skipped() {
    let runner = Runner::start().await;
    let token = Token {
        workflow: "Jobber".into(),
        execution_id: ExecutionId::derive("Jobber", "x"),
        deferred: "DurableQueue/Jobs/x".into(),
    };
    let bad = [
        ("not-json", "not json".to_owned()),
        ("bad-token", r#"{"token":"%%%","payload":{"id":"a"}}"#.to_owned()),
        ("bad-payload", format!(r#"{{"token":"{}","payload":5}}"#, token.encode())),
    ];
    for (id, element) in &bad {
        assert!(runner.queue.offer("DurableQueue/Jobs", id, element).await.unwrap());
    }
    let runs = Arc::new(AtomicU32::new(0));
    register_counting_worker(&runner.engine, &runs);
    let id = runner.engine.execute_discard::<Jobber>(input("good")).await.unwrap();
    let exit = suite::complete_exit::<Jobber>(&runner.engine, &id).await;
    assert_eq!(exit, Exit::Success(RawJson::encode("done:good").unwrap()));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the good item ran");
    for ((id, _), reason) in bad.iter().zip(["element", "token", "payload"]) {
        let item = item_in(&runner, ("DurableQueue/Jobs", id), QueueItemState::Failed).await;
        assert_eq!(item.attempts, 1, "{id}");
        let failure = item.last_failure.unwrap_or_default();
        assert!(failure.contains(reason), "{id}: {failure}");
    }
    let good = runner.item(&id, "good").await;
    assert_eq!((good.state, good.attempts), (QueueItemState::Completed, 1));
    runner.engine.shutdown().await;
    runner.sharding.shutdown().await;
}

/// A result that cannot be recorded (saving the deferred's completion fails) is retried as the
/// item's next attempt after the retry delay; the second attempt completes the workflow.
#[tokio::test(start_paused = true)]
async fn a_result_that_cannot_be_recorded_is_retried_as_the_next_attempt() {
    let runner = Runner::start().await;
    let runs = Arc::new(AtomicU32::new(0));
    let (worker_runs, faults) = (Arc::clone(&runs), Arc::clone(&runner.faults));
    runner
        .engine
        .register_queue_worker(
            JOBS,
            move |job: Job| {
                let (runs, faults) = (Arc::clone(&worker_runs), Arc::clone(&faults));
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        // The completion of the first attempt's deferred is not stored.
                        faults.fail_request_saves(1);
                    }
                    Ok::<_, String>(format!("done:{}", job.id))
                }
            },
            1,
        )
        .unwrap();
    let id = runner.engine.execute_discard::<Jobber>(input("flaky")).await.unwrap();
    let exit = suite::complete_exit::<Jobber>(&runner.engine, &id).await;
    assert_eq!(exit, Exit::Success(RawJson::encode("done:flaky").unwrap()));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let item = runner.item(&id, "flaky").await;
    assert_eq!((item.state, item.attempts), (QueueItemState::Completed, 2));
    assert!(item.last_failure.is_some(), "the first attempt's failure is recorded");
    runner.engine.shutdown().await;
    runner.sharding.shutdown().await;
}

/// A worker stopped with its engine interrupts its item and releases it without counting the
/// attempt; a worker in another process (serving no shard) takes it and completes the workflow.
#[tokio::test(start_paused = true)]
async fn a_stopped_worker_releases_its_item_to_other_workers() {
    let runner = Runner::start().await;
    let started = Arc::new(Mutex::new(Vec::new()));
    let first_started = Arc::clone(&started);
    runner
        .engine
        .register_queue_worker(
            JOBS,
            move |job: Job| {
                let started = Arc::clone(&first_started);
                async move {
                    started.lock().unwrap().push(job.id);
                    std::future::pending::<Result<String, String>>().await
                }
            },
            1,
        )
        .unwrap();
    let id = runner.engine.execute_discard::<Jobber>(input("moved")).await.unwrap();
    eventually("the first worker started the item", || !started.lock().unwrap().is_empty()).await;
    assert!(runner.item(&id, "moved").await.claimed);
    runner.engine.shutdown().await;
    let released = runner.item(&id, "moved").await;
    assert_eq!((released.state, released.attempts), (QueueItemState::Pending, 0));
    assert!(!released.claimed);
    let (client, other) = runner.client().await;
    let runs = Arc::new(AtomicU32::new(0));
    register_counting_worker(&other, &runs);
    let exit = suite::complete_exit::<Jobber>(&runner.engine, &id).await;
    assert_eq!(exit, Exit::Success(RawJson::encode("done:moved").unwrap()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let item = runner.item(&id, "moved").await;
    assert_eq!((item.state, item.attempts), (QueueItemState::Completed, 1));
    other.shutdown().await;
    client.shutdown().await;
    runner.sharding.shutdown().await;
}

/// A worker that panics is a defect of its item: the workflow fails with it.
#[tokio::test(start_paused = true)]
async fn a_panicking_worker_fails_its_item_with_a_defect() {
    let runner = Runner::start().await;
    runner
        .engine
        .register_queue_worker(
            JOBS,
            |job: Job| async move {
                assert!(job.id.is_empty(), "the worker fails on {}", job.id);
                Ok::<String, String>(job.id)
            },
            1,
        )
        .unwrap();
    let id = runner.engine.execute_discard::<Jobber>(input("boom")).await.unwrap();
    let exit = suite::complete_exit::<Jobber>(&runner.engine, &id).await;
    let Exit::Failure(cause) = exit else { panic!("the workflow succeeded: {exit:?}") };
    assert!(cause.0.iter().any(|reason| matches!(reason, CauseReason::Die(_))), "{cause:?}");
    assert_eq!(runner.item(&id, "boom").await.state, QueueItemState::Completed);
    runner.engine.shutdown().await;
    runner.sharding.shutdown().await;
}

/// Without a queue storage an engine refuses queue workers.
#[tokio::test(start_paused = true)]
async fn queue_workers_need_a_queue_storage() {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let messages = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let sharding = Sharding::standalone(config(), messages).clock(clock).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    let registered = engine.register_queue_worker(JOBS, |job: Job| async move { Ok(job.id) }, 1);
    assert!(matches!(registered, Err(WorkflowError::Invalid(_))), "{registered:?}");
    sharding.shutdown().await;
}
