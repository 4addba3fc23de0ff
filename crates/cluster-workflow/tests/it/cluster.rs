//! The suite on the cluster engine: one runner with every shard, on the in-memory storage
//! with tokio's paused clock (and, in `sql`, on SQLite, PostgreSQL and MySQL with a real one).

use std::sync::Arc;
use std::time::Duration;

use cluster_core::{Clock, ShardingConfig, Timestamp};
use cluster_sharding::Sharding;
use cluster_testkit::memory::MemoryMessageStorage;
use cluster_workflow::WorkflowEngine;

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

impl Harness for ClusterOnMemory {
    async fn engine(&self) -> WorkflowEngine {
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let storage = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
        let sharding = Sharding::with_storage(config(), clock, storage).await.unwrap();
        WorkflowEngine::cluster(&sharding).unwrap()
    }

    fn is_cluster(&self) -> bool {
        true
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
    concurrent_activities_with_one_name_run_once,
    concurrent_activities_finish_before_the_run_suspends,
    durable_sleep_wakes_the_run,
    short_sleeps_are_activities,
    first_completion_wins,
    interrupting_unknown_or_completed_executions_is_a_no_op,
    unregistered_workflows_are_an_error,
);
