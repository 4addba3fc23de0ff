//! A workflow's options: [`WorkflowOptions`] and the [`RetrySchedule`] of a suspended
//! execution. (The [`Workflow`](crate::Workflow) trait lives with the engine that runs it.)

use std::time::Duration;

use cluster_core::ShardGroup;

/// How the executions of a workflow behave (the reference's annotations and options).
#[derive(Clone, Debug)]
pub struct WorkflowOptions {
    /// A defect (a panic, a value that cannot be decoded) completes the execution with a `Die`
    /// failure (`true`, the default); with `false` it leaves no result: the in-memory engine
    /// reports the defect to callers and the cluster engine retries the run.
    pub capture_defects: bool,
    /// A failure of the body or of an activity suspends the execution (`failed: true`) instead
    /// of completing it, until an explicit [`resume`](crate::WorkflowEngine::resume) or an
    /// interrupt. `false` by default.
    pub suspend_on_failure: bool,
    /// How often an external caller of `execute` polls a suspended execution.
    pub suspended_retry: RetrySchedule,
    /// The shard group of an execution id (cluster engine); `default` when `None`.
    pub shard_group: Option<fn(&str) -> ShardGroup>,
}

impl Default for WorkflowOptions {
    fn default() -> WorkflowOptions {
        WorkflowOptions {
            capture_defects: true,
            suspend_on_failure: false,
            suspended_retry: RetrySchedule::default(),
            shard_group: None,
        }
    }
}

/// A retry schedule: `min(initial × factor^n, max)` between attempts, for at most `attempts`
/// attempts (`None`: without end).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetrySchedule {
    /// The first delay.
    pub initial: Duration,
    /// The growth of each next delay.
    pub factor: f64,
    /// The largest delay.
    pub max: Duration,
    /// How many delays the schedule gives before it ends.
    pub attempts: Option<u32>,
}

impl Default for RetrySchedule {
    /// The reference's `suspendedRetrySchedule`: `min(exponential(200 ms, 1.5), spaced(30 s))`,
    /// without end.
    fn default() -> RetrySchedule {
        RetrySchedule {
            initial: Duration::from_millis(200),
            factor: 1.5,
            max: Duration::from_secs(30),
            attempts: None,
        }
    }
}

impl RetrySchedule {
    /// The delay before retry `n` (0-based), or `None` once the schedule has ended.
    pub fn delay(&self, n: u32) -> Option<Duration> {
        if self.attempts.is_some_and(|attempts| n >= attempts) {
            return None;
        }
        let exponent = i32::try_from(n.min(64)).unwrap_or(64);
        let delay = self.initial.as_secs_f64() * self.factor.powi(exponent);
        Some(if delay.is_finite() && delay < self.max.as_secs_f64() {
            Duration::from_secs_f64(delay)
        } else {
            self.max
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_schedule_grows_to_its_cap_and_a_bounded_one_ends() {
        let schedule = RetrySchedule::default();
        assert_eq!(schedule.delay(0), Some(Duration::from_millis(200)));
        assert_eq!(schedule.delay(1), Some(Duration::from_millis(300)));
        assert_eq!(schedule.delay(20), Some(Duration::from_secs(30)));
        assert_eq!(schedule.delay(u32::MAX), Some(Duration::from_secs(30)));
        let bounded = RetrySchedule { attempts: Some(2), ..schedule };
        assert!(bounded.delay(1).is_some());
        assert_eq!(bounded.delay(2), None);
    }
}
