//! The suite on the cluster engine: one runner with every shard, on the in-memory storage
//! with tokio's paused clock (and, in `sql`, on SQLite, PostgreSQL and MySQL with a real one).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cluster_core::{Clock, ShardingConfig, Timestamp};
use cluster_sharding::Sharding;
use cluster_testkit::memory::{MemoryMessageStorage, MemoryQueueStorage};
use cluster_workflow::{ClusterOptions, WorkflowEngine};

use crate::suite::{self, Harness};

/// The wall clock as tokio's (paused) clock moves: deliver-at times follow the test's time.
#[derive(Debug)]
pub(crate) struct TokioClock {
    origin: Timestamp,
    start: tokio::time::Instant,
}

impl TokioClock {
    pub(crate) fn new() -> TokioClock {
        TokioClock {
            origin: Timestamp::from_unix_millis(1_700_000_000_000),
            start: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        self.origin.saturating_add(self.start.elapsed())
    }
}

/// One runner with every shard on in-memory storage whose faults the test controls, and its
/// workflow engine.
async fn engine_on_faulty_storage() -> (WorkflowEngine, Arc<cluster_testkit::faulty::Faults>) {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let memory = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let (faulty, faults) = cluster_testkit::faulty::FaultyMessageStorage::new(memory);
    let sharding = Sharding::standalone(config(), Arc::new(faulty))
        .clock(Arc::clone(&clock))
        .start()
        .await
        .unwrap();
    (WorkflowEngine::cluster_with(&sharding, memory_queue(clock)).unwrap(), faults)
}

/// The engine options of the suite: durable queues on an in-memory queue store.
pub(crate) fn memory_queue(clock: Arc<dyn Clock>) -> ClusterOptions {
    let storage = Arc::new(MemoryQueueStorage::new(clock));
    ClusterOptions { queue_storage: Some(storage), ..ClusterOptions::default() }
}

/// The runner configuration of the suite: quick polls.
pub(crate) fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(50),
        entity_reply_poll_interval: Duration::from_millis(50),
        entity_termination_timeout: Duration::from_millis(200),
        ..ShardingConfig::default()
    }
}

struct ClusterOnMemory;

/// The memory storage's value limit in the suite: MySQL's `TEXT`, so that the suite meets
/// the smallest limit of the SQL backends on every run.
const MEMORY_VALUE_BYTES_MAX: usize = 65_535;

impl Harness for ClusterOnMemory {
    async fn engine(&self) -> WorkflowEngine {
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let storage = MemoryMessageStorage::new(Arc::clone(&clock));
        let storage = Arc::new(storage.with_value_bytes_max(MEMORY_VALUE_BYTES_MAX));
        let sharding = Sharding::standalone(config(), storage)
            .clock(Arc::clone(&clock))
            .start()
            .await
            .unwrap();
        WorkflowEngine::cluster_with(&sharding, memory_queue(clock)).unwrap()
    }

    fn is_cluster(&self) -> bool {
        true
    }

    fn value_bytes_max(&self) -> Option<usize> {
        Some(MEMORY_VALUE_BYTES_MAX)
    }
}

macro_rules! cluster_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[tokio::test(start_paused = true)]
            async fn $name() {
                suite::$name(&ClusterOnMemory).await;
            }
        )*
    };
}

cluster_tests!(
    executes_and_polls,
    discard_returns_the_deterministic_execution_id,
    executing_again_attaches_to_the_execution,
    a_completed_deferred_wakes_an_active_run,
    superseded_runs_finalize_after_the_final_run,
    body_finalizers_do_not_see_a_deposited_interrupt,
    workflow_finalizers_see_a_deposited_interrupt,
    interrupt_unsafe_applies_across_a_suspended_replay,
    email_workflow_suspends_resumes_and_deduplicates,
    interrupting_a_suspended_execution_runs_its_compensation_once,
    compensation_runs_once_when_the_execution_fails,
    compensation_scenario_matrix,
    compensations_run_in_reverse_order_with_the_cause,
    activity_race_returns_the_first_success_and_drops_the_losers,
    activity_race_ignores_a_failure_when_another_branch_succeeds,
    activity_race_fails_when_every_branch_fails,
    deferred_race_lets_a_deferred_win_while_a_branch_is_active,
    deferred_race_lets_an_active_branch_win,
    a_late_completion_of_a_losing_deferred_does_not_preempt,
    a_race_replays_its_recorded_winner,
    a_race_suspends_when_every_branch_waits,
    awaits_inside_an_activity_do_not_preempt_the_run,
    a_child_completion_wakes_its_parent,
    an_interrupted_parent_interrupts_its_child,
    an_interrupted_child_wakes_its_parent_with_a_result,
    suspend_on_failure_suspends_and_an_explicit_resume_replays,
    interrupting_a_failed_suspension_keeps_the_original_failure,
    automatic_wakes_do_not_resume_a_failed_suspension,
    a_caught_activity_defect_lets_the_workflow_go_on,
    an_uncaught_activity_defect_completes_with_a_die,
    a_body_panic_is_a_defect,
    retries_number_attempts_and_keep_the_last_error,
    an_interrupted_activity_runs_again_and_completes,
    an_activity_failing_on_its_own_is_not_retried_on_interrupt,
    an_activity_interrupted_past_its_retries_dies,
    concurrent_activities_with_one_name_run_once,
    concurrent_activities_finish_before_the_run_suspends,
    durable_sleep_wakes_the_run,
    short_sleeps_are_activities,
    first_completion_wins,
    interrupting_unknown_or_completed_executions_is_a_no_op,
    unregistered_workflows_are_an_error,
    a_queue_worker_result_resumes_the_workflow,
    a_queue_worker_failure_fails_the_workflow,
    a_queue_item_is_offered_once_across_replays,
    a_bare_durable_clock_branch_wins,
    a_waking_branch_runs_its_own_steps_again,
    a_multi_await_branch_replays_per_completion,
    a_race_of_waiting_activities_suspends,
    a_finalizer_panicking_before_its_future_ends_the_execution,
    a_queue_worker_panicking_before_its_future_is_a_defect,
    a_body_finalizer_panicking_at_a_suspension_lets_the_run_suspend,
    reserved_names_are_refused,
    tokens_cannot_complete_ahead_of_an_execution_or_the_engines_records,
    values_over_the_storage_limit_are_typed_errors,
);

/// New in effect 4.1.0 (`ensureSuccess`): a wake that keeps failing (here: the run's reset) is
/// given up when the runner shuts down, and its request is left stored for the next owner, which
/// wakes the execution. On 4.0.6 the wake retried without end and held the shutdown until the
/// termination timeout.
#[tokio::test(start_paused = true)]
async fn a_failing_wake_is_left_for_the_next_owner_at_shutdown() {
    use cluster_core::storage::MessageStorage;
    use cluster_testkit::faulty::FaultyMessageStorage;
    use cluster_workflow::{DurableDeferred, Never, Workflow, WorkflowContext};

    struct Gated;
    impl Workflow for Gated {
        const NAME: &'static str = "Gated";
        type Payload = suite::Input;
        type Success = String;
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }
    fn register(engine: &WorkflowEngine) {
        Gated::register(engine, |ctx: WorkflowContext, _: suite::Input| async move {
            ctx.await_deferred(&DurableDeferred::<String>::new("Gate").unwrap()).await
        })
        .unwrap();
    }

    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let memory: Arc<dyn MessageStorage> = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let (faulty, faults) = FaultyMessageStorage::new(Arc::clone(&memory));
    let patient =
        ShardingConfig { entity_termination_timeout: Duration::from_secs(60), ..config() };
    let first = Sharding::standalone(patient, Arc::new(faulty))
        .clock(Arc::clone(&clock))
        .start()
        .await
        .unwrap();
    let engine = WorkflowEngine::cluster(&first).unwrap();
    register(&engine);
    let payload = suite::Input { key: "held".into(), ..suite::Input::default() };
    let id = engine.execute_discard::<Gated>(payload).await.unwrap();
    suite::suspended::<Gated>(&engine, &id).await;
    faults.fail_clear_replies(u32::MAX);
    let token = DurableDeferred::<String>::new("Gate").unwrap().token_for::<Gated>(&id);
    engine.complete(&token, Ok::<String, Never>("opened".into())).await.unwrap();
    // The deferred's handler now retries the run's reset.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(30), first.shutdown())
        .await
        .expect("the shutdown was held by a wake that retries without end");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    // The completion is stored and unanswered: the next owner handles it.
    assert_unanswered::<Gated>(&*memory, &first, &id, "Gate").await;
    let second = Sharding::standalone(config(), memory).clock(clock).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&second).unwrap();
    register(&engine);
    // The next owner wakes the execution.
    let exit = suite::complete_exit::<Gated>(&engine, &id).await;
    assert_eq!(exit, cluster_core::Exit::Success(cluster_core::RawJson::encode("opened").unwrap()));
}

/// Asserts that deferred `name` of execution `id` of `W` has a stored completion without a
/// final reply (left for the next owner).
async fn assert_unanswered<W: cluster_workflow::Workflow>(
    storage: &dyn cluster_core::storage::MessageStorage,
    sharding: &Sharding,
    id: &cluster_workflow::ExecutionId,
    name: &str,
) {
    use cluster_core::envelope::{Reply, primary_key};

    let address = cluster_core::EntityAddress {
        shard_id: sharding.shard_id(id.as_str(), &cluster_core::ShardGroup::default_group()),
        entity_type: format!("Workflow/{}", W::NAME).into(),
        entity_id: id.as_str().into(),
    };
    let key = primary_key(&address, "deferred", name);
    let request = storage.request_id_for_primary_key(&key).await.unwrap().expect("stored");
    let replies = storage.replies_for(&[request]).await.unwrap();
    assert!(!replies.iter().any(|reply| matches!(reply, Reply::WithExit(_))), "{replies:?}");
}

/// Reference cluster test #20: a durable clock of a workflow in the `workflow` shard group is
/// a request of `Workflow/-/DurableClock` in that group, delivered at the wake-up rounded up to
/// the next millisecond (10 000.5 ms → start + 10 001), and it wakes the workflow.
#[tokio::test(start_paused = true)]
async fn durable_clocks_go_to_the_workflow_shard_group_at_the_rounded_up_millisecond() {
    use cluster_core::ShardGroup;
    use cluster_core::storage::MessageStorage;
    use cluster_workflow::{Never, Workflow, WorkflowContext, WorkflowOptions};

    struct Grouped;
    impl Workflow for Grouped {
        const NAME: &'static str = "Grouped";
        type Payload = suite::Input;
        type Success = ();
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
        fn options() -> WorkflowOptions {
            WorkflowOptions {
                shard_group: Some(|_| ShardGroup::from("workflow")),
                ..WorkflowOptions::default()
            }
        }
    }

    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let storage: Arc<dyn MessageStorage> = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let groups = vec![ShardGroup::default_group(), ShardGroup::from("workflow")];
    let config = ShardingConfig {
        available_shard_groups: groups.clone(),
        assigned_shard_groups: groups,
        ..config()
    };
    let sharding = Sharding::standalone(config, Arc::clone(&storage))
        .clock(Arc::clone(&clock))
        .start()
        .await
        .unwrap();
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    Grouped::register(&engine, |ctx: WorkflowContext, _: suite::Input| async move {
        ctx.sleep_with_threshold("nap", Duration::from_micros(10_000_500), Duration::ZERO).await;
        Ok(())
    })
    .unwrap();
    let start = clock.now();
    let id = engine
        .execute_discard::<Grouped>(suite::Input { key: "g".into(), ..suite::Input::default() })
        .await
        .unwrap();
    let address = cluster_core::EntityAddress {
        shard_id: sharding.shard_id(id.as_str(), &ShardGroup::from("workflow")),
        entity_type: cluster_workflow::CLOCK_ENTITY.into(),
        entity_id: id.as_str().into(),
    };
    let key = cluster_core::envelope::primary_key(&address, "run", "nap");
    let mut request = None;
    for _ in 0..100 {
        request = storage.request_id_for_primary_key(&key).await.unwrap();
        if request.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let request = request.expect("the clock request is stored");
    let at = |millis: u64| start.saturating_add(Duration::from_millis(millis));
    let early = storage.unprocessed_messages_by_id(&[request], at(10_000)).await.unwrap();
    assert!(early.messages.is_empty(), "not due at start + 10 000 ms");
    let due = storage.unprocessed_messages_by_id(&[request], at(10_001)).await.unwrap();
    let [message] = due.messages.as_slice() else { panic!("due at start + 10 001 ms: {due:?}") };
    assert_eq!(message.envelope.address(), &address, "in the workflow's shard group");
    // The clock wakes the workflow.
    assert_eq!(suite::complete_exit::<Grouped>(&engine, &id).await, cluster_core::Exit::void());
    assert!(clock.now() >= at(10_001));
}

/// A completion that arrives after the run's body
/// stopped but before its `Suspended` reply is stored (here every reply write takes a
/// second) still wakes the execution.
#[tokio::test(start_paused = true)]
async fn a_completion_during_the_suspension_commit_wakes_the_run() {
    a_completion_during_a_slow_suspension_commit_wakes_the_run(Duration::from_secs(1)).await;
}

/// A reply write can take longer than any fixed wait (lock confirmation, write retries, a pool
/// wait, a backed-up group commit): a wake that arrives meanwhile waits for the reply instead
/// of giving up on it. Here every reply write takes seven seconds; the wake used to give up
/// after about five and the execution stayed suspended.
#[tokio::test(start_paused = true)]
async fn a_completion_during_a_very_slow_suspension_commit_wakes_the_run() {
    a_completion_during_a_slow_suspension_commit_wakes_the_run(Duration::from_secs(7)).await;
}

/// Every reply write takes `delay`; the run suspends at once and its deferred is completed
/// while its `Suspended` reply is being written.
async fn a_completion_during_a_slow_suspension_commit_wakes_the_run(delay: Duration) {
    use cluster_workflow::{DurableDeferred, Never, Workflow, WorkflowContext};

    struct Committing;
    impl Workflow for Committing {
        const NAME: &'static str = "Committing";
        type Payload = suite::Input;
        type Success = String;
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }

    let (engine, faults) = engine_on_faulty_storage().await;
    faults.delay_replies(delay);
    let started = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let runs = Arc::clone(&started);
    Committing::register(&engine, move |ctx: WorkflowContext, _: suite::Input| {
        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move { ctx.await_deferred(&DurableDeferred::<String>::new("Gate").unwrap()).await }
    })
    .unwrap();
    let payload = suite::Input { key: "commit".into(), ..suite::Input::default() };
    let id = engine.execute_discard::<Committing>(payload).await.unwrap();
    // The run starts and suspends at once; its reply is written `delay` later.
    for _ in 0..100 {
        if started.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(engine.poll::<Committing>(&id).await.unwrap(), None, "the reply is not stored yet");
    let token = DurableDeferred::<String>::new("Gate").unwrap().token_for::<Committing>(&id);
    engine.complete(&token, Ok::<String, Never>("late".into())).await.unwrap();
    // The completion wakes the execution.
    let exit = suite::complete_exit::<Committing>(&engine, &id).await;
    assert_eq!(exit, cluster_core::Exit::Success(cluster_core::RawJson::encode("late").unwrap()));
    assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A wake waiting for a slow `Suspended` reply ends when its runner shuts down, and leaves its
/// completion stored for the next owner, which wakes the execution.
#[tokio::test(start_paused = true)]
async fn a_wake_waiting_for_a_slow_suspension_commit_is_left_for_the_next_owner_at_shutdown() {
    use cluster_core::storage::MessageStorage;
    use cluster_testkit::faulty::FaultyMessageStorage;
    use cluster_workflow::{DurableDeferred, Never, Workflow, WorkflowContext};

    struct Slow;
    impl Workflow for Slow {
        const NAME: &'static str = "SlowCommit";
        type Payload = suite::Input;
        type Success = String;
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }
    fn register(engine: &WorkflowEngine) {
        Slow::register(engine, |ctx: WorkflowContext, _: suite::Input| async move {
            ctx.await_deferred(&DurableDeferred::<String>::new("Gate").unwrap()).await
        })
        .unwrap();
    }

    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let memory: Arc<dyn MessageStorage> = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let (faulty, faults) = FaultyMessageStorage::new(Arc::clone(&memory));
    // A drain that would wait a minute for the wake.
    let patient =
        ShardingConfig { entity_termination_timeout: Duration::from_secs(60), ..config() };
    let first = Sharding::standalone(patient, Arc::new(faulty))
        .clock(Arc::clone(&clock))
        .start()
        .await
        .unwrap();
    let engine = WorkflowEngine::cluster(&first).unwrap();
    register(&engine);
    faults.delay_replies(Duration::from_secs(30));
    let payload = suite::Input { key: "slow".into(), ..suite::Input::default() };
    let id = engine.execute_discard::<Slow>(payload).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(engine.poll::<Slow>(&id).await.unwrap(), None, "the reply is not stored yet");
    let token = DurableDeferred::<String>::new("Gate").unwrap().token_for::<Slow>(&id);
    engine.complete(&token, Ok::<String, Never>("later".into())).await.unwrap();
    // The deferred's handler now waits for the run's reply.
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::time::timeout(Duration::from_secs(120), first.shutdown())
        .await
        .expect("the shutdown was held by a wake waiting for a reply");
    // The wake stopped waiting at the shutdown: its completion is left unanswered, although
    // the run's reply was stored before the drain ended.
    assert_unanswered::<Slow>(&*memory, &first, &id, "Gate").await;
    let second = Sharding::standalone(config(), memory).clock(clock).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&second).unwrap();
    register(&engine);
    let exit = suite::complete_exit::<Slow>(&engine, &id).await;
    assert_eq!(exit, cluster_core::Exit::Success(cluster_core::RawJson::encode("later").unwrap()));
    second.shutdown().await;
}

/// A completion that an activity awaited, arriving after the activity suspended and before
/// its run ended (here the activity's `Suspended` reply takes a second to write), wakes the
/// execution: the run keeps its activities' waits until it ends, after the activity's own run
/// is gone.
#[tokio::test(start_paused = true)]
async fn a_completion_awaited_inside_an_activity_wakes_the_suspending_run() {
    use std::sync::atomic::{AtomicU32, Ordering};

    use cluster_workflow::{DurableDeferred, Never, Workflow, WorkflowContext};

    struct Inner;
    impl Workflow for Inner {
        const NAME: &'static str = "InnerGate";
        type Payload = suite::Input;
        type Success = String;
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }

    let (engine, faults) = engine_on_faulty_storage().await;
    faults.delay_replies(Duration::from_secs(1));
    let attempts = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&attempts);
    Inner::register(&engine, move |ctx: WorkflowContext, _: suite::Input| {
        let counted = Arc::clone(&counted);
        async move {
            ctx.activity("waits", move |activity| {
                counted.fetch_add(1, Ordering::SeqCst);
                async move {
                    let gate = DurableDeferred::<String>::new("Gate").unwrap();
                    activity.context().await_deferred(&gate).await
                }
            })
            .await
        }
    })
    .unwrap();
    let payload = suite::Input { key: "inner".into(), ..suite::Input::default() };
    let id = engine.execute_discard::<Inner>(payload).await.unwrap();
    // The activity starts and suspends at once; its reply is written a second later.
    for _ in 0..100 {
        if attempts.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(attempts.load(Ordering::SeqCst), 1, "the activity started");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(engine.poll::<Inner>(&id).await.unwrap(), None, "the run has not ended yet");
    let token = DurableDeferred::<String>::new("Gate").unwrap().token_for::<Inner>(&id);
    engine.complete(&token, Ok::<String, Never>("opened".into())).await.unwrap();
    // The completion wakes the execution, whose replay runs the activity again.
    let exit = suite::complete_exit::<Inner>(&engine, &id).await;
    assert_eq!(exit, cluster_core::Exit::Success(cluster_core::RawJson::encode("opened").unwrap()));
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
}

/// Reference cluster tests #21 and #23: a workflow in the `workflow` shard group, on a runner
/// that serves only that group: its run, activities and deferred completions (here from a
/// client-only process that knows the definition from a typed call) all land there.
#[tokio::test(start_paused = true)]
async fn traffic_of_a_workflow_goes_to_its_shard_group_from_every_process() {
    use cluster_core::ShardGroup;
    use cluster_core::storage::MessageStorage;
    use cluster_workflow::{DurableDeferred, Never, Workflow, WorkflowContext, WorkflowOptions};

    struct Sharded;
    impl Workflow for Sharded {
        const NAME: &'static str = "Sharded";
        type Payload = suite::Input;
        type Success = String;
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
        fn options() -> WorkflowOptions {
            WorkflowOptions {
                shard_group: Some(|_| ShardGroup::from("workflow")),
                ..WorkflowOptions::default()
            }
        }
    }

    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let storage: Arc<dyn MessageStorage> = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let available = vec![ShardGroup::default_group(), ShardGroup::from("workflow")];
    let runner_config = ShardingConfig {
        available_shard_groups: available.clone(),
        assigned_shard_groups: vec![ShardGroup::from("workflow")],
        ..config()
    };
    let runner = Sharding::standalone(runner_config, Arc::clone(&storage))
        .clock(Arc::clone(&clock))
        .start()
        .await
        .unwrap();
    let engine = WorkflowEngine::cluster(&runner).unwrap();
    Sharded::register(&engine, |ctx: WorkflowContext, _: suite::Input| async move {
        let act: String =
            ctx.activity("act", |_| async { Ok::<_, Never>("act".to_owned()) }).await?;
        let gate = ctx.await_deferred(&DurableDeferred::<String>::new("Gate").unwrap()).await?;
        Ok(format!("{act}:{gate}"))
    })
    .unwrap();
    let client_config =
        ShardingConfig { runner_address: None, available_shard_groups: available, ..config() };
    let client = Sharding::client_only(client_config, storage).clock(clock).start().await.unwrap();
    let remote = WorkflowEngine::cluster(&client).unwrap();
    let id = remote
        .execute_discard::<Sharded>(suite::Input { key: "s".into(), ..suite::Input::default() })
        .await
        .unwrap();
    // The run and its activity ran in the workflow group.
    suite::suspended::<Sharded>(&remote, &id).await;
    let token = DurableDeferred::<String>::new("Gate").unwrap().token_for::<Sharded>(&id);
    remote.complete(&token, Ok::<String, Never>("gate".into())).await.unwrap();
    // The completion reached the workflow's shard group.
    let exit = suite::complete_exit::<Sharded>(&remote, &id).await;
    assert_eq!(
        exit,
        cluster_core::Exit::Success(cluster_core::RawJson::encode("act:gate").unwrap())
    );
}

/// Found by the simulation (seed 1 with workflows): a run that the engine breaks off (here
/// the next activity's request cannot be stored) ends with no result and is replayed; it
/// must not run the compensations of the steps it completed, since the execution has not
/// failed (the replay below succeeds).
#[tokio::test(start_paused = true)]
async fn a_run_broken_by_an_engine_failure_runs_no_compensation() {
    use std::sync::atomic::{AtomicU32, Ordering};

    use cluster_workflow::{Never, Workflow, WorkflowContext};

    struct Broken;
    impl Workflow for Broken {
        const NAME: &'static str = "Broken";
        type Payload = suite::Input;
        type Success = String;
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }

    let (engine, faults) = engine_on_faulty_storage().await;
    let (compensations, runs) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (undone, started) = (Arc::clone(&compensations), Arc::clone(&runs));
    Broken::register(&engine, move |ctx: WorkflowContext, _: suite::Input| {
        started.fetch_add(1, Ordering::SeqCst);
        let (undone, faults) = (Arc::clone(&undone), Arc::clone(&faults));
        async move {
            let hold: String = ctx
                .activity("reserve", move |_| {
                    // The next request saves fail: the run cannot store its next step.
                    faults.fail_request_saves(1);
                    async { Ok::<_, Never>("hold".to_owned()) }
                })
                .compensate(move |_, _| async move {
                    undone.fetch_add(1, Ordering::SeqCst);
                })
                .await?;
            let charge: String =
                ctx.activity("charge", |_| async { Ok::<_, Never>("paid".to_owned()) }).await?;
            Ok(format!("{hold}/{charge}"))
        }
    })
    .unwrap();
    let payload = suite::Input { key: "broken".into(), ..suite::Input::default() };
    let outcome = engine.execute::<Broken>(payload).await;
    assert_eq!(outcome.unwrap(), "hold/paid");
    assert!(runs.load(Ordering::SeqCst) >= 2, "the broken run was replayed");
    assert_eq!(compensations.load(Ordering::SeqCst), 0, "nothing was undone");
}

/// Found by the simulation (seed 30 with workflows): an activity ran, but its result could not
/// be stored (every write attempt failed), so the runtime delivered the activity's request
/// again, found no caller waiting and answered it `Suspended`. The run waiting for the first
/// delivery's reply got that `Suspended` and suspended with nothing left to wake it. The run
/// now breaks off instead and is replayed, which runs the activity again.
#[tokio::test(start_paused = true)]
async fn an_activity_whose_result_was_not_stored_runs_again() {
    use std::sync::atomic::{AtomicU32, Ordering};

    use cluster_workflow::{Never, Workflow, WorkflowContext};

    struct Unstored;
    impl Workflow for Unstored {
        const NAME: &'static str = "Unstored";
        type Payload = suite::Input;
        type Success = u32;
        type Error = Never;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }

    let (engine, faults) = engine_on_faulty_storage().await;
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    Unstored::register(&engine, move |ctx: WorkflowContext, _: suite::Input| {
        let (counted, faults) = (Arc::clone(&counted), Arc::clone(&faults));
        async move {
            ctx.activity("reserve", move |_| {
                let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                if run == 1 {
                    // Every write of the first run's result fails.
                    faults.fail_reply_saves(4);
                }
                async move { Ok::<_, Never>(run) }
            })
            .await
        }
    })
    .unwrap();
    let payload = suite::Input { key: "unstored".into(), ..suite::Input::default() };
    let outcome =
        tokio::time::timeout(Duration::from_secs(120), engine.execute::<Unstored>(payload)).await;
    let Ok(outcome) = outcome else { panic!("the execution stayed suspended") };
    assert_eq!(outcome.unwrap(), 2, "the second run's result is the stored one");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The workflows of `a_child_failing_during_its_runners_drain_compensates_once`.
mod drained {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use cluster_workflow::{DurableDeferred, Workflow, WorkflowContext, WorkflowEngine};
    use tokio::sync::Semaphore;

    use crate::suite;

    pub(super) struct Child;
    impl Workflow for Child {
        const NAME: &'static str = "DrainedChild";
        type Payload = suite::Input;
        type Success = String;
        type Error = String;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }

    pub(super) struct Parent;
    impl Workflow for Parent {
        const NAME: &'static str = "DrainedParent";
        type Payload = suite::Input;
        type Success = String;
        type Error = String;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }

    /// What both runners' bodies share: compensation runs, starts of the failing activity,
    /// and the permits it waits for.
    #[derive(Clone)]
    pub(super) struct Probe {
        pub(super) compensations: Arc<AtomicU32>,
        pub(super) failing: Arc<AtomicU32>,
        pub(super) release: Arc<Semaphore>,
    }

    /// The child reserves (with a compensation), waits for `Go`, then fails in an activity
    /// that waits for a permit; the parent runs the child.
    pub(super) fn register(engine: &WorkflowEngine, probe: &Probe) {
        let p = probe.clone();
        Child::register(engine, move |ctx: WorkflowContext, _: suite::Input| {
            let p = p.clone();
            async move {
                let undo = Arc::clone(&p.compensations);
                ctx.activity("reserve", |_| async { Ok::<_, String>("held".to_owned()) })
                    .compensate(move |_, _| async move {
                        undo.fetch_add(1, Ordering::SeqCst);
                    })
                    .await?;
                ctx.await_deferred(&DurableDeferred::<()>::new("Go").unwrap())
                    .await
                    .unwrap_or_else(|never| match never {});
                ctx.activity("charge", move |_| {
                    let p = p.clone();
                    async move {
                        p.failing.fetch_add(1, Ordering::SeqCst);
                        let _permit = p.release.acquire().await;
                        Err::<String, _>("declined".to_owned())
                    }
                })
                .await
            }
        })
        .unwrap();
        Parent::register(engine, |ctx: WorkflowContext, payload: suite::Input| async move {
            let child = suite::Input { key: format!("{}-child", payload.key), ..payload };
            ctx.child::<Child>(child).await
        })
        .unwrap();
    }
}

/// A child that fails while its runner drains cannot wake its parent there (the runner gives
/// the wake up at once), so it stores no result and the next owner replays it: the child's
/// compensation must run on one of the two runners only. It used to run on both, since the
/// scope was closed before the wake was tried.
#[tokio::test(start_paused = true)]
async fn a_child_failing_during_its_runners_drain_compensates_once() {
    use std::sync::atomic::Ordering;

    use cluster_core::storage::MessageStorage;
    use cluster_workflow::{DurableDeferred, Never, Workflow};

    use self::drained::{Child, Parent, Probe};

    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let memory: Arc<dyn MessageStorage> = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let probe = Probe {
        compensations: Arc::default(),
        failing: Arc::default(),
        release: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    // The drain waits for the child's run to finish.
    let patient =
        ShardingConfig { entity_termination_timeout: Duration::from_secs(60), ..config() };
    let first = Sharding::standalone(patient, Arc::clone(&memory))
        .clock(Arc::clone(&clock))
        .start()
        .await
        .unwrap();
    let engine = WorkflowEngine::cluster(&first).unwrap();
    drained::register(&engine, &probe);
    let payload = suite::Input { key: "drained".into(), ..suite::Input::default() };
    let id = engine.execute_discard::<Parent>(payload).await.unwrap();
    let child = Child::execution_id(&suite::Input {
        key: "drained-child".into(),
        ..suite::Input::default()
    });
    suite::suspended::<Child>(&engine, &child).await;
    suite::suspended::<Parent>(&engine, &id).await;
    let go = DurableDeferred::<()>::new("Go").unwrap().token_for::<Child>(&child);
    engine.complete(&go, Ok::<(), Never>(())).await.unwrap();
    // The child's replay is in its failing activity when the runner starts to drain.
    for _ in 0..1_000 {
        if probe.failing.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(probe.failing.load(Ordering::SeqCst), 1, "the failing activity started");
    let stopping = first.clone();
    let shutdown = tokio::spawn(async move { stopping.shutdown().await });
    for _ in 0..1_000 {
        if first.is_shutdown() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(first.is_shutdown(), "the runner drains");
    probe.release.add_permits(1);
    tokio::time::timeout(Duration::from_secs(120), shutdown)
        .await
        .expect("the first runner shut down")
        .unwrap();
    // The next owner finishes the child and wakes the parent.
    let second = Sharding::standalone(config(), memory).clock(clock).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&second).unwrap();
    drained::register(&engine, &probe);
    let declined = cluster_core::Exit::fail(cluster_core::RawJson::encode("declined").unwrap());
    assert_eq!(suite::complete_exit::<Child>(&engine, &child).await, declined);
    assert_eq!(suite::complete_exit::<Parent>(&engine, &id).await, declined);
    assert_eq!(probe.compensations.load(Ordering::SeqCst), 1, "the compensation ran once");
    second.shutdown().await;
}

/// A registration the runtime refuses keeps the runtime's typed error as its source.
#[tokio::test(start_paused = true)]
async fn a_refused_registration_keeps_the_runtimes_error() {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let memory = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let sharding = Sharding::standalone(config(), memory).clock(clock).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    sharding.shutdown().await;
    struct Greet;
    impl cluster_workflow::Workflow for Greet {
        const NAME: &'static str = "Greet";
        type Payload = String;
        type Success = String;
        type Error = String;
        fn idempotency_key(name: &String) -> String {
            name.clone()
        }
    }
    use cluster_workflow::Workflow as _;
    let refused = Greet::register(&engine, |_context, name| async move { Ok(name) });
    let Err(cluster_workflow::WorkflowError::Register { entity_type, source }) = refused else {
        panic!("a shut-down runtime accepted a workflow: {refused:?}");
    };
    assert_eq!(entity_type, "Workflow/Greet");
    assert!(
        matches!(*source, cluster_sharding::RegisterError::ShuttingDown),
        "the runtime's error is kept: {source:?}"
    );
}

/// A `suspend_on_failure` run fails and its `Suspended` reply takes seven seconds to store.
/// A completion of a deferred the run does not await (an automatic wake) waits for that reply;
/// an interrupt arriving meanwhile must still be applied once the reply is stored. Before the
/// fix the automatic wake took the "reply pending" mark, the interrupt's wake read no reply and
/// did nothing, and the execution stayed suspended.
#[tokio::test(start_paused = true)]
async fn an_interrupt_during_an_automatic_wakes_wait_for_a_slow_reply_is_applied() {
    use cluster_workflow::{DurableDeferred, Never, Workflow, WorkflowContext, WorkflowOptions};

    struct FailsSlowly;
    impl Workflow for FailsSlowly {
        const NAME: &'static str = "FailsSlowly";
        type Payload = suite::Input;
        type Success = String;
        type Error = String;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
        fn options() -> WorkflowOptions {
            WorkflowOptions { suspend_on_failure: true, ..WorkflowOptions::default() }
        }
    }

    let (engine, faults) = engine_on_faulty_storage().await;
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    FailsSlowly::register(&engine, move |_: WorkflowContext, _: suite::Input| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err::<String, _>("boom".to_owned()) }
    })
    .unwrap();
    faults.delay_replies(Duration::from_secs(7));
    let payload = suite::Input { key: "slow-failure".into(), ..suite::Input::default() };
    let id = engine.execute_discard::<FailsSlowly>(payload).await.unwrap();
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(engine.poll::<FailsSlowly>(&id).await.unwrap(), None, "the reply is not stored yet");
    // The automatic wake: a deferred the run never awaits.
    let other = DurableDeferred::<String>::new("Other").unwrap().token_for::<FailsSlowly>(&id);
    engine.complete(&other, Ok::<String, Never>("unawaited".into())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    engine.interrupt::<FailsSlowly>(&id).await.unwrap();
    let exit = suite::complete_exit::<FailsSlowly>(&engine, &id).await;
    assert_eq!(exit, cluster_core::Exit::fail(cluster_core::RawJson::encode("boom").unwrap()));
}

/// A durable queue item over the queue store's limit ends the run with a defect that names
/// the refusal, instead of breaking the run for a replay that offers it again without end.
#[tokio::test(start_paused = true)]
async fn a_queue_item_over_the_stores_limit_is_a_defect() {
    use cluster_workflow::{DurableQueue, ExecuteError, Workflow, WorkflowContext};

    struct Enqueues;
    impl Workflow for Enqueues {
        const NAME: &'static str = "Enqueues";
        type Payload = suite::Input;
        type Success = u64;
        type Error = String;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }
    const BIG: DurableQueue<String, u64, String> =
        DurableQueue::new("Big", |item: &String| item.len().to_string());

    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let storage = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let queue = MemoryQueueStorage::new(Arc::clone(&clock)).with_value_bytes_max(2_048);
    let sharding = Sharding::standalone(config(), storage).clock(clock).start().await.unwrap();
    let options =
        ClusterOptions { queue_storage: Some(Arc::new(queue)), ..ClusterOptions::default() };
    let engine = WorkflowEngine::cluster_with(&sharding, options).unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    Enqueues::register(&engine, move |ctx: WorkflowContext, _: suite::Input| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move { BIG.process(&ctx, "x".repeat(4_096)).await }
    })
    .unwrap();
    engine
        .register_queue_worker(BIG, |item: String| async move { Ok(item.len() as u64) }, 1)
        .unwrap();
    let payload = suite::Input { key: "big".into(), ..suite::Input::default() };
    let outcome =
        tokio::time::timeout(Duration::from_secs(120), engine.execute::<Enqueues>(payload))
            .await
            .expect("the execution never ended");
    assert!(
        matches!(&outcome, Err(ExecuteError::Defect(defect)) if defect.contains("refused")),
        "{outcome:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the run was not replayed");
    sharding.shutdown().await;
}

/// `interrupt_unsafe` cuts off a run while its activity's result is being written (replies take
/// two seconds). The next run, with the interrupt pending, starts no new activity, but it waits
/// for that result: the step's compensation is registered and runs when the interrupt ends the
/// execution. Before the fix the next run read "no result", suspended, and the execution ended
/// interrupted with the step never undone.
#[tokio::test(start_paused = true)]
async fn an_activity_result_written_during_an_unsafe_interrupt_is_compensated() {
    use cluster_workflow::{DurableDeferred, Workflow, WorkflowContext};

    struct Reserving;
    impl Workflow for Reserving {
        const NAME: &'static str = "Reserving";
        type Payload = suite::Input;
        type Success = String;
        type Error = String;
        fn idempotency_key(payload: &suite::Input) -> String {
            payload.key.clone()
        }
    }

    let (engine, faults) = engine_on_faulty_storage().await;
    let (ran, undone) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (counted, compensated) = (Arc::clone(&ran), Arc::clone(&undone));
    Reserving::register(&engine, move |ctx: WorkflowContext, _: suite::Input| {
        let (counted, compensated) = (Arc::clone(&counted), Arc::clone(&compensated));
        async move {
            ctx.activity("reserve", |_| {
                let counted = Arc::clone(&counted);
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    Ok::<u32, String>(1)
                }
            })
            .compensate(move |_, _| async move {
                compensated.fetch_add(1, Ordering::SeqCst);
            })
            .await?;
            let gate = DurableDeferred::<String>::new("Gate").unwrap();
            ctx.await_deferred(&gate).await.map_err(|never| match never {})
        }
    })
    .unwrap();
    faults.delay_replies(Duration::from_secs(2));
    let payload = suite::Input { key: "reserving".into(), ..suite::Input::default() };
    let id = engine.execute_discard::<Reserving>(payload).await.unwrap();
    while ran.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The activity's result is being written; the run waits for it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    engine.interrupt_unsafe::<Reserving>(&id).await.unwrap();
    let exit = suite::complete_exit::<Reserving>(&engine, &id).await;
    assert!(
        matches!(&exit, cluster_core::Exit::Failure(cause) if cause.has_interrupts_only()),
        "{exit:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the activity ran once");
    assert_eq!(undone.load(Ordering::SeqCst), 1, "its stored result was undone once");
}
