//! How the CLI and the console write times and flags for an operator.

use std::time::Duration;

use cluster_core::Timestamp;
use cluster_core::envelope::Exit;
use cluster_core::inspect::{Backlog, RunnerRecord};
use cluster_workflow::inspect::ExecutionSummary;

/// The columns of a runner, as [`runner_cells`] fills them.
pub(crate) const RUNNER_COLUMNS: [&str; 7] =
    ["Address", "Machine", "Groups", "Weight", "Healthy", "Alive", "Heartbeat"];

/// A runner's cells, as plain text.
pub(crate) fn runner_cells(record: &RunnerRecord) -> Vec<String> {
    let groups: Vec<String> = record.runner.groups.iter().map(ToString::to_string).collect();
    vec![
        record.runner.address.to_string(),
        record.machine_id.get().to_string(),
        groups.join(", "),
        record.runner.weight.get().to_string(),
        yes(record.healthy),
        yes(record.alive),
        format!("{} ago", age(record.heartbeat_age)),
    ]
}

/// The columns of a backlog, as [`backlog_cells`] fills them.
pub(crate) const BACKLOG_COLUMNS: [&str; 7] =
    ["Entity type", "Shard", "Due", "Scheduled", "Claimed", "Stale claims", "Oldest"];

/// A backlog's cells at `now`, as plain text.
pub(crate) fn backlog_cells(backlog: &Backlog, now: Timestamp) -> Vec<String> {
    let oldest =
        if backlog.waiting_since.is_some() { age(backlog.oldest_age(now)) } else { "-".into() };
    vec![
        backlog.entity_type.clone(),
        backlog.shard_id.to_string(),
        backlog.due.to_string(),
        backlog.scheduled.to_string(),
        backlog.claimed.to_string(),
        backlog.stale_claims.to_string(),
        oldest,
    ]
}

/// A flag as `yes` or `no`.
pub(crate) fn yes(flag: bool) -> String {
    if flag { "yes" } else { "no" }.to_owned()
}

/// A duration as an operator reads it: `850ms`, `12s`, `3m 20s`, `2h 5m`, `3d 4h`.
pub(crate) fn age(duration: Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0 => format!("{}ms", duration.as_millis()),
        1..60 => format!("{seconds}s"),
        60..3_600 => format!("{}m {}s", seconds / 60, seconds % 60),
        3_600..86_400 => format!("{}h {}m", seconds / 3_600, seconds % 3_600 / 60),
        _ => format!("{}d {}h", seconds / 86_400, seconds % 86_400 / 3_600),
    }
}

/// A time relative to `now`: `in 5s` or `3s ago`.
pub(crate) fn relative(now: Timestamp, at: Timestamp) -> String {
    if at > now {
        format!("in {}", age(at.saturating_duration_since(now)))
    } else {
        format!("{} ago", age(now.saturating_duration_since(at)))
    }
}

/// An execution's status, and whether its own `suspend_on_failure` suspended it.
pub(crate) fn status_text(summary: &ExecutionSummary) -> String {
    if summary.suspended_on_failure {
        format!("{} (on failure)", summary.status)
    } else {
        summary.status.to_string()
    }
}

/// How an exit ended, in a word: `success`, `interrupted`, `defect` or `failure`.
pub(crate) fn exit_summary(exit: &Exit) -> &'static str {
    match exit {
        Exit::Success(_) => "success",
        Exit::Failure(cause) if cause.has_interrupts_only() => "interrupted",
        Exit::Failure(_) if super::is_defect(exit) => "defect",
        Exit::Failure(_) => "failure",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_an_operator_reads_them() {
        assert_eq!(age(Duration::from_millis(850)), "850ms");
        assert_eq!(age(Duration::from_secs(12)), "12s");
        assert_eq!(age(Duration::from_secs(200)), "3m 20s");
        assert_eq!(age(Duration::from_secs(7_500)), "2h 5m");
        assert_eq!(age(Duration::from_secs(3 * 86_400 + 4 * 3_600)), "3d 4h");
    }
}
