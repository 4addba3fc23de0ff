//! The workflow metrics, reported through the `metrics` facade by both engines, labelled with
//! the registered `workflow` name (never an execution id or an activity name, which may be
//! made at run time):
//!
//! | name | kind | labels | meaning |
//! | --- | --- | --- | --- |
//! | `effect_cluster_workflow_runs_started_total` | counter | `workflow` | runs of a workflow body: an execution's first run, and each run after a suspension or a replay |
//! | `effect_cluster_workflow_runs_ended_total` | counter | `workflow`, `outcome` | how runs ended: `completed` (the execution succeeded), `failed` (it ended with a failure, a defect or an interrupt), `suspended` (it waits on a deferred, a clock or an activity) or `stopped` (no result: cut off by a shutdown, a storage failure or a defect with `capture_defects` off) |
//! | `effect_cluster_workflow_activity_attempts_total` | counter | `workflow` | activity attempts run (a replay's memoized results are not counted) |
//! | `effect_cluster_workflow_activity_retries_total` | counter | `workflow`, `cause` | attempts that run again: `failure` (an attempt after a failed one, under `retry`) or `interrupt` (the same attempt after an interruption) |
//! | `effect_cluster_workflow_executions_deleted_total` | counter | | completed executions deleted by workflow retention on this runner (no label: the names come from storage) |

/// Runs of a workflow body started, by `workflow`.
pub const RUNS_STARTED: &str = "effect_cluster_workflow_runs_started_total";
/// Runs of a workflow body ended, by `workflow` and `outcome`.
pub const RUNS_ENDED: &str = "effect_cluster_workflow_runs_ended_total";
/// Activity attempts run, by `workflow`.
pub const ACTIVITY_ATTEMPTS: &str = "effect_cluster_workflow_activity_attempts_total";
/// Activity attempts run again, by `workflow` and `cause`.
pub const ACTIVITY_RETRIES: &str = "effect_cluster_workflow_activity_retries_total";

/// Completed executions deleted by workflow retention.
pub const EXECUTIONS_DELETED: &str = "effect_cluster_workflow_executions_deleted_total";

/// Counts an execution deleted by workflow retention.
pub(crate) fn execution_deleted() {
    metrics::counter!(EXECUTIONS_DELETED).increment(1);
}

/// Counts a run of `workflow`'s body.
pub(crate) fn run_started(workflow: &'static str) {
    metrics::counter!(RUNS_STARTED, "workflow" => workflow).increment(1);
}

/// How a run ended, for the `outcome` label.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RunEnd {
    /// The execution succeeded.
    Completed,
    /// The execution ended with a failure, a defect or an interrupt.
    Failed,
    /// The run suspended.
    Suspended,
    /// The run was cut off without a result.
    Stopped,
}

/// Counts how a run of `workflow` ended.
pub(crate) fn run_ended(workflow: &'static str, end: RunEnd) {
    let outcome = match end {
        RunEnd::Completed => "completed",
        RunEnd::Failed => "failed",
        RunEnd::Suspended => "suspended",
        RunEnd::Stopped => "stopped",
    };
    metrics::counter!(RUNS_ENDED, "workflow" => workflow, "outcome" => outcome).increment(1);
}

/// Counts an activity attempt of `workflow`; `retry` says why it runs again, if it does.
pub(crate) fn activity_attempt(workflow: &'static str, retry: Option<Retry>) {
    metrics::counter!(ACTIVITY_ATTEMPTS, "workflow" => workflow).increment(1);
    if let Some(retry) = retry {
        let cause = match retry {
            Retry::Failure => "failure",
            Retry::Interrupt => "interrupt",
        };
        metrics::counter!(ACTIVITY_RETRIES, "workflow" => workflow, "cause" => cause).increment(1);
    }
}

/// Why an activity attempt runs again.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Retry {
    /// The previous attempt failed.
    Failure,
    /// The same attempt was interrupted.
    Interrupt,
}
