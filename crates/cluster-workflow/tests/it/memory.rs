//! The suite on the in-memory engine, with tokio's paused clock (sleeps advance at once when
//! every task is idle).

use cluster_workflow::WorkflowEngine;

use crate::suite::{self, Harness};

struct Memory;

impl Harness for Memory {
    async fn engine(&self) -> WorkflowEngine {
        WorkflowEngine::memory()
    }
}

macro_rules! memory_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[tokio::test(start_paused = true)]
            async fn $name() {
                suite::$name(&Memory).await;
            }
        )*
    };
}

memory_tests!(
    executes_and_polls,
    discard_returns_the_deterministic_execution_id,
    executing_again_attaches_to_the_execution,
    a_completed_deferred_wakes_an_active_run,
    shutdown_interrupts_waiting_callers,
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
    without_capture_defects_a_defect_leaves_no_result,
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
    a_body_panic_is_a_defect,
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
);
