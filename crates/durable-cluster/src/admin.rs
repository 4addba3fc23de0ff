//! [`Admin`]: what an operator sees of a cluster and the fixes it may apply, on the storage
//! alone (feature `admin`).
//!
//! The CLI (`durable-cluster admin`), the operations server's `/admin` endpoints and its web
//! console all go through it. It needs no runner: it reads and writes the tables, and the
//! runners pick its writes up as they pick up any stored request.
//!
//! Reads: the runners, the shard map (owner by assignment and by lock), backlogs, requests,
//! workflow executions and one execution's timeline, and the stuck work
//! ([`Admin::stuck`]).
//!
//! Actions, each idempotent and logged with who asked (`tracing`, target
//! `durable_cluster::admin`):
//!
//! | action | what it writes |
//! | --- | --- |
//! | [`interrupt`](Admin::interrupt) | the execution's interrupt signal, as `WorkflowEngine::interrupt` stores it |
//! | [`resume`](Admin::resume) | resets a suspended execution's `run`, so it runs again |
//! | [`complete_deferred`](Admin::complete_deferred) | a deferred's completion (success or failure) |
//! | [`retry`](Admin::retry) | deletes a request's final reply that is a defect, so it is delivered again (the reference's `reset`) |
//! | [`cancel`](Admin::cancel) | an interrupt of an unprocessed request |
//! | [`release_claim`](Admin::release_claim) | releases an unprocessed request's claim, so any runner may read it |
//! | [`purge`](Admin::purge) | deletes a finished execution: its requests, replies and clock |
//!
//! An action that finds nothing to do answers [`Action::Unchanged`] with the reason, and
//! writes nothing: a second click or a retried command is harmless.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{
    Cause, CauseReason, Exit, Interrupt, RawJson, Request, TraceContext, primary_key,
};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::inspect::{
    Backlog, BacklogQuery, LockHolder, RequestQuery, RequestRecord, RunnerRecord, ShardLock,
};
use cluster_core::retention::replied_before;
use cluster_core::storage::{MessageStorage, RunnerStorage, SaveRequestOptions, SaveResult};
use cluster_core::{
    Clock, EntityAddress, EntityType, HashRing, MachineId, RunnerAddress, ShardId, ShardingConfig,
    SharedSnowflakeGenerator, Snowflake, SystemClock, Timestamp,
};
use cluster_workflow::inspect::{
    self as workflows, ExecutionDetail, ExecutionPage, ExecutionQuery, ExecutionStatus,
};
use cluster_workflow::{CLOCK_ENTITY, INTERRUPT_SIGNAL, RESERVED_DEFERRED_PREFIXES};

#[cfg(feature = "cli")]
pub mod cli;
pub mod json;
#[cfg(any(feature = "cli", feature = "console"))]
mod text;
#[cfg(feature = "console")]
pub mod web;

/// The machine id of the snowflakes the admin's writes are made with: the largest. A runner
/// whose own id collides would make an id taken already; the write is then retried with the
/// next one.
const ADMIN_MACHINE_ID: i32 = 1023;

/// How many times a write whose id is taken is retried with a new id.
const ID_ATTEMPTS: u32 = 3;

/// How many poll intervals (`ENTITY_MESSAGE_POLL_INTERVAL`) a due message may wait before its
/// backlog is reported stuck, by default.
pub const STUCK_POLL_INTERVALS: u32 = 60;

/// The most suspended executions [`Admin::stuck`] checks for a completion they missed.
pub const STUCK_EXECUTIONS_CHECKED: u32 = 100;

/// How many of an execution's requests after its suspension the missed-wake check reads.
const MISSED_WAKE_REQUESTS: u32 = 10;

/// What an admin call failed with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The storage failed.
    #[error("storage: {0}")]
    Storage(#[from] StorageError),
    /// What the call names does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The call cannot apply to what it names, for the reason given.
    #[error("refused: {0}")]
    Refused(String),
}

/// What an action did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// It wrote what the message says.
    Done(String),
    /// It found nothing to do, for the reason given, and wrote nothing.
    Unchanged(String),
}

impl Action {
    /// The message.
    pub fn message(&self) -> &str {
        match self {
            Action::Done(message) | Action::Unchanged(message) => message,
        }
    }

    /// Whether it wrote something.
    pub fn changed(&self) -> bool {
        matches!(self, Action::Done(_))
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Done(message) => write!(f, "done: {message}"),
            Action::Unchanged(message) => write!(f, "unchanged: {message}"),
        }
    }
}

/// One shard of the shard map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardView {
    /// The shard.
    pub shard_id: ShardId,
    /// The runner the assignment gives it to: the hash ring of the live, healthy runners that
    /// serve its group.
    pub assigned: Option<RunnerAddress>,
    /// Who holds its lock, as the database sees it.
    pub lock: Option<ShardLock>,
}

impl ShardView {
    /// Whether the lock holder is the assigned runner (or neither exists). A disagreement is
    /// normal for a moment while shards move; one that lasts is a stuck handoff.
    pub fn agrees(&self) -> bool {
        match (&self.assigned, &self.lock) {
            (None, None) => true,
            (Some(assigned), Some(lock)) => {
                !lock.expired && lock.holder == LockHolder::Runner(assigned.clone())
            }
            _ => false,
        }
    }
}

/// A backlog that waits too long, with its shard's lock holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StuckBacklog {
    /// The backlog.
    pub backlog: Backlog,
    /// Who holds the shard's lock (the runner that should consume it), if anyone.
    pub holder: Option<LockHolder>,
}

/// Work that does not move ([`Admin::stuck`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StuckWork {
    /// When it was computed.
    pub at: Timestamp,
    /// The age past which a due message is stuck.
    pub threshold: Duration,
    /// Backlogs whose oldest due message waited longer than the threshold, or with stale
    /// claims: a runner holds the shard and does not consume it.
    pub backlogs: Vec<StuckBacklog>,
    /// Suspended executions with a completion stored after they suspended, older than the
    /// threshold: it did not wake them.
    pub executions: Vec<workflows::ExecutionSummary>,
}

impl StuckWork {
    /// Whether anything is stuck.
    pub fn is_empty(&self) -> bool {
        self.backlogs.is_empty() && self.executions.is_empty()
    }
}

/// An operator's view of one cluster's storage, and its fixes.
pub struct Admin {
    messages: Arc<dyn MessageStorage>,
    runners: Arc<dyn RunnerStorage>,
    config: ShardingConfig,
    clock: Arc<dyn Clock>,
    ids: SharedSnowflakeGenerator,
}

impl fmt::Debug for Admin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admin")
            .field("messages", &self.messages.backend_name())
            .field("runners", &self.runners.backend_name())
            .finish_non_exhaustive()
    }
}

impl Admin {
    /// The admin of the cluster whose storages these are, with its settings (the shard groups,
    /// shards per group and poll interval).
    pub fn new(
        messages: Arc<dyn MessageStorage>,
        runners: Arc<dyn RunnerStorage>,
        config: ShardingConfig,
    ) -> Admin {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        Admin::with_clock(messages, runners, config, clock)
    }

    /// [`Admin::new`] with its own clock.
    pub fn with_clock(
        messages: Arc<dyn MessageStorage>,
        runners: Arc<dyn RunnerStorage>,
        config: ShardingConfig,
        clock: Arc<dyn Clock>,
    ) -> Admin {
        let ids = SharedSnowflakeGenerator::new(MachineId::new(ADMIN_MACHINE_ID), clock.now());
        Admin { messages, runners, config, clock, ids }
    }

    /// The cluster's settings.
    pub fn config(&self) -> &ShardingConfig {
        &self.config
    }

    /// The current time, by the admin's clock.
    pub fn now(&self) -> Timestamp {
        self.clock.now()
    }

    // --- Reads ---------------------------------------------------------------------------------

    /// Every registered runner.
    ///
    /// # Errors
    ///
    /// The storage's.
    pub async fn runners(&self) -> Result<Vec<RunnerRecord>, AdminError> {
        Ok(self.runners.runner_records().await?)
    }

    /// Every shard of the available groups: its owner by assignment and its lock.
    ///
    /// # Errors
    ///
    /// The storage's.
    pub async fn shards(&self) -> Result<Vec<ShardView>, AdminError> {
        let runners = self.runners.runner_records().await?;
        let mut rings: BTreeMap<_, HashRing<RunnerAddress>> = BTreeMap::new();
        for record in runners.iter().filter(|record| record.alive && record.healthy) {
            for group in &record.runner.groups {
                rings
                    .entry(group.clone())
                    .or_default()
                    .add(record.runner.address.clone(), record.runner.weight.get());
            }
        }
        let shards_per_group = self.config.shards_per_group;
        let mut views = Vec::new();
        for group in &self.config.available_shard_groups {
            let owners = rings.get(group).and_then(|ring| ring.get_shards(shards_per_group));
            for number in 1..=shards_per_group {
                let index = usize::try_from(number - 1).unwrap_or(usize::MAX);
                let assigned = owners.as_ref().and_then(|owners| owners.get(index)).cloned();
                views.push(ShardView {
                    shard_id: ShardId::new(group.clone(), number),
                    assigned: assigned.cloned(),
                    lock: None,
                });
            }
        }
        let ids: Vec<ShardId> = views.iter().map(|view| view.shard_id.clone()).collect();
        let locks: BTreeMap<ShardId, ShardLock> = self
            .runners
            .shard_locks(&ids)
            .await?
            .into_iter()
            .map(|lock| (lock.shard_id.clone(), lock))
            .collect();
        for view in &mut views {
            view.lock = locks.get(&view.shard_id).cloned();
        }
        Ok(views)
    }

    /// The backlogs, the longest wait first; a claim older than `stale_after` is stale.
    ///
    /// # Errors
    ///
    /// The storage's (a limit outside 1 to 1,000 included).
    pub async fn backlog(
        &self,
        stale_after: Duration,
        limit: u32,
    ) -> Result<Vec<Backlog>, AdminError> {
        let query = BacklogQuery { now: self.now(), stale_after, limit };
        Ok(self.messages.backlog(&query).await?)
    }

    /// Requests, as `query` selects them.
    ///
    /// # Errors
    ///
    /// The storage's.
    pub async fn requests(&self, query: &RequestQuery) -> Result<Vec<RequestRecord>, AdminError> {
        Ok(self.messages.requests(query).await?)
    }

    /// One request.
    ///
    /// # Errors
    ///
    /// [`AdminError::NotFound`] when no request has this id.
    pub async fn request(&self, request_id: Snowflake) -> Result<RequestRecord, AdminError> {
        let query = RequestQuery { request_id: Some(request_id), ..RequestQuery::all(1) };
        self.messages
            .requests(&query)
            .await?
            .pop()
            .ok_or_else(|| AdminError::NotFound(format!("no request has the id {request_id}")))
    }

    /// Workflow executions, newest first.
    ///
    /// # Errors
    ///
    /// The storage's.
    pub async fn workflows(&self, query: &ExecutionQuery) -> Result<ExecutionPage, AdminError> {
        Ok(workflows::executions(&*self.messages, query).await?)
    }

    /// One execution with its timeline.
    ///
    /// # Errors
    ///
    /// [`AdminError::NotFound`] when the execution has no `run` request.
    pub async fn workflow(
        &self,
        workflow: &str,
        execution_id: &str,
    ) -> Result<ExecutionDetail, AdminError> {
        workflows::execution(&*self.messages, workflow, execution_id).await?.ok_or_else(|| {
            AdminError::NotFound(format!("workflow {workflow} has no execution {execution_id}"))
        })
    }

    /// The age past which a due message is stuck: [`STUCK_POLL_INTERVALS`] poll intervals.
    pub fn stuck_threshold(&self) -> Duration {
        self.config.entity_message_poll_interval.saturating_mul(STUCK_POLL_INTERVALS)
    }

    /// The work that does not move: backlogs whose oldest due message waited longer than
    /// `threshold` (or with claims older than it), with their shard's lock holder; and the
    /// newest suspended executions (at most [`STUCK_EXECUTIONS_CHECKED`]) that a completion
    /// stored after they suspended, longer than `threshold` ago, did not wake.
    ///
    /// # Errors
    ///
    /// The storage's.
    pub async fn stuck(&self, threshold: Duration) -> Result<StuckWork, AdminError> {
        let now = self.now();
        let backlogs = self.backlog(threshold, cluster_core::inspect::LIMIT_MAX).await?;
        let late: Vec<Backlog> = backlogs
            .into_iter()
            .filter(|backlog| backlog.oldest_age(now) > threshold || backlog.stale_claims > 0)
            .collect();
        let shards: Vec<ShardId> = late.iter().map(|backlog| backlog.shard_id.clone()).collect();
        let holders: BTreeMap<ShardId, LockHolder> = if shards.is_empty() {
            BTreeMap::new()
        } else {
            self.runners
                .shard_locks(&shards)
                .await?
                .into_iter()
                .map(|lock| (lock.shard_id, lock.holder))
                .collect()
        };
        let backlogs = late
            .into_iter()
            .map(|backlog| {
                let holder = holders.get(&backlog.shard_id).cloned();
                StuckBacklog { backlog, holder }
            })
            .collect();
        let query = ExecutionQuery {
            status: Some(ExecutionStatus::Suspended),
            ..ExecutionQuery::newest(STUCK_EXECUTIONS_CHECKED)
        };
        let suspended = workflows::executions(&*self.messages, &query).await?;
        let mut executions = Vec::new();
        for summary in suspended.executions {
            if summary.suspended_on_failure {
                continue;
            }
            let Some(suspended_at) = summary.updated else { continue };
            if self.missed_wake(&summary, suspended_at, now, threshold).await? {
                executions.push(summary);
            }
        }
        Ok(StuckWork { at: now, threshold, backlogs, executions })
    }

    /// Whether a completion (a deferred's or a child's wake) was stored for the execution
    /// after it suspended at `suspended_at`, longer than `threshold` ago. Reads the first
    /// requests after the suspension, through the execution's shard.
    async fn missed_wake(
        &self,
        summary: &workflows::ExecutionSummary,
        suspended_at: Timestamp,
        now: Timestamp,
        threshold: Duration,
    ) -> Result<bool, AdminError> {
        let after = Snowflake::new(replied_before(suspended_at).get().saturating_sub(1));
        let query = RequestQuery {
            shard_id: Some(summary.shard_id.clone()),
            entity_type: Some(format!("Workflow/{}", summary.workflow)),
            entity_id: Some(summary.execution_id.clone()),
            after: Some(after),
            ..RequestQuery::all(MISSED_WAKE_REQUESTS)
        };
        let later = self.messages.requests(&query).await?;
        Ok(later.iter().any(|record| {
            matches!(record.tag.as_str(), "deferred" | "resume")
                && record.reply.is_some()
                && now.saturating_duration_since(record.request_id.timestamp()) > threshold
        }))
    }

    // --- Actions -------------------------------------------------------------------------------

    /// Interrupts an execution: stores its interrupt signal, which wakes it to run its
    /// compensations and end interrupted.
    ///
    /// # Errors
    ///
    /// [`AdminError::NotFound`] when the execution does not exist; the storage's.
    pub async fn interrupt(
        &self,
        actor: &str,
        workflow: &str,
        execution_id: &str,
    ) -> Result<Action, AdminError> {
        let run = self.run(workflow, execution_id).await?;
        let action = if run.status.is_finished() {
            Action::Unchanged(format!("the execution is {}", run.status))
        } else {
            let stored = self.store_deferred(&run.address, INTERRUPT_SIGNAL, &Exit::void()).await?;
            if stored {
                Action::Done("the interrupt is stored; the execution wakes to handle it".into())
            } else {
                Action::Unchanged("the execution was interrupted already".into())
            }
        };
        log(actor, "interrupt", &format!("{workflow}/{execution_id}"), &action);
        Ok(action)
    }

    /// Resumes a suspended execution: resets its `run` so that it runs again. A suspension
    /// by its own `suspend_on_failure` is resumed too.
    ///
    /// # Errors
    ///
    /// [`AdminError::NotFound`] when the execution does not exist; the storage's.
    pub async fn resume(
        &self,
        actor: &str,
        workflow: &str,
        execution_id: &str,
    ) -> Result<Action, AdminError> {
        let run = self.run(workflow, execution_id).await?;
        let action = match (run.status, &run.record.reply) {
            (ExecutionStatus::Suspended, Some(reply)) => {
                self.messages.clear_replies(run.record.request_id, Some(reply.id)).await?;
                Action::Done("the run is reset; a runner runs it again".into())
            }
            (status, _) => Action::Unchanged(format!("the execution is {status}, not suspended")),
        };
        log(actor, "resume", &format!("{workflow}/{execution_id}"), &action);
        Ok(action)
    }

    /// Completes the deferred `name` of an execution with `exit`; the first completion
    /// stored wins.
    ///
    /// # Errors
    ///
    /// [`AdminError::Refused`] for a name the engine reserves; [`AdminError::NotFound`] when
    /// the execution does not exist; the storage's.
    pub async fn complete_deferred(
        &self,
        actor: &str,
        workflow: &str,
        execution_id: &str,
        name: &str,
        exit: &Exit,
    ) -> Result<Action, AdminError> {
        if name.is_empty()
            || RESERVED_DEFERRED_PREFIXES.iter().any(|prefix| name.starts_with(prefix))
        {
            return Err(AdminError::Refused(format!(
                "{name:?} is not a deferred an operator may complete: the engine reserves \
                 names that start with {RESERVED_DEFERRED_PREFIXES:?} (use interrupt)"
            )));
        }
        let run = self.run(workflow, execution_id).await?;
        let action = if run.status.is_finished() {
            Action::Unchanged(format!("the execution is {}", run.status))
        } else if self.store_deferred(&run.address, name, exit).await? {
            Action::Done(format!("the deferred {name} is completed"))
        } else {
            Action::Unchanged(format!("the deferred {name} was completed already"))
        };
        log(actor, "complete_deferred", &format!("{workflow}/{execution_id}/{name}"), &action);
        Ok(action)
    }

    /// Retries a request whose final reply is a defect: deletes the reply, so that the
    /// request is delivered again (the reference's `reset`).
    ///
    /// # Errors
    ///
    /// [`AdminError::Refused`] when its final reply is not a defect; [`AdminError::NotFound`]
    /// when it does not exist; the storage's.
    pub async fn retry(&self, actor: &str, request_id: Snowflake) -> Result<Action, AdminError> {
        let record = self.request(request_id).await?;
        let action = match &record.reply {
            None => Action::Unchanged("the request has no final reply: it waits or runs".into()),
            Some(reply) if is_defect(&reply.exit) => {
                self.messages.clear_replies(request_id, Some(reply.id)).await?;
                Action::Done("the defect reply is deleted; the request is delivered again".into())
            }
            Some(_) => {
                return Err(AdminError::Refused(
                    "its final reply is not a defect: only a request that died is retried".into(),
                ));
            }
        };
        log(actor, "retry", &request_id.to_string(), &action);
        Ok(action)
    }

    /// Cancels an unprocessed request: stores an interrupt of it, which its entity receives
    /// as a caller's interrupt.
    ///
    /// # Errors
    ///
    /// [`AdminError::NotFound`] when it does not exist; the storage's.
    pub async fn cancel(&self, actor: &str, request_id: Snowflake) -> Result<Action, AdminError> {
        let record = self.request(request_id).await?;
        let action = if record.reply.is_some() || record.processed {
            Action::Unchanged("the request is processed".into())
        } else if record.interrupted {
            Action::Unchanged("the request was cancelled already".into())
        } else {
            self.with_new_id(|id| {
                let interrupt = Interrupt {
                    id,
                    address: record.address.clone(),
                    request_id: record.request_id,
                };
                let messages = Arc::clone(&self.messages);
                async move { messages.save_interrupt(&interrupt).await }
            })
            .await?;
            Action::Done("an interrupt of the request is stored".into())
        };
        log(actor, "cancel", &request_id.to_string(), &action);
        Ok(action)
    }

    /// Releases the claim on an unprocessed request, so that the runner of its shard reads
    /// it again.
    ///
    /// # Errors
    ///
    /// [`AdminError::NotFound`] when it does not exist; the storage's.
    pub async fn release_claim(
        &self,
        actor: &str,
        request_id: Snowflake,
    ) -> Result<Action, AdminError> {
        let record = self.request(request_id).await?;
        let action = if record.claimed {
            self.messages.reset_requests(&[request_id]).await?;
            Action::Done("the claim is released".into())
        } else {
            Action::Unchanged("the request is not claimed".into())
        };
        log(actor, "release_claim", &request_id.to_string(), &action);
        Ok(action)
    }

    /// Deletes a finished execution: every request and reply of its entity and of its clock.
    /// Its id then runs again if started again.
    ///
    /// # Errors
    ///
    /// [`AdminError::Refused`] while it runs or is suspended, or while its parent has not
    /// finished (the parent may still read its result); the storage's.
    pub async fn purge(
        &self,
        actor: &str,
        workflow: &str,
        execution_id: &str,
    ) -> Result<Action, AdminError> {
        let run = match self.run(workflow, execution_id).await {
            Ok(run) => run,
            Err(AdminError::NotFound(_)) => {
                let action = Action::Unchanged("no such execution is stored".into());
                log(actor, "purge", &format!("{workflow}/{execution_id}"), &action);
                return Ok(action);
            }
            Err(error) => return Err(error),
        };
        if !run.status.is_finished() {
            return Err(AdminError::Refused(format!(
                "the execution is {}: only a finished execution is purged (interrupt it first)",
                run.status
            )));
        }
        if let Some(parent) = &run.summary.parent {
            let parent_run = self.run(&parent.workflow, &parent.execution_id).await;
            if parent_run.is_ok_and(|parent| !parent.status.is_finished()) {
                return Err(AdminError::Refused(format!(
                    "its parent {}/{} has not finished and may still read its result",
                    parent.workflow, parent.execution_id
                )));
            }
        }
        self.messages.clear_address(&run.address).await?;
        let clock =
            EntityAddress { entity_type: EntityType::from(CLOCK_ENTITY), ..run.address.clone() };
        self.messages.clear_address(&clock).await?;
        let action =
            Action::Done("the execution's requests, replies and clocks are deleted".into());
        log(actor, "purge", &format!("{workflow}/{execution_id}"), &action);
        Ok(action)
    }

    // --- Helpers -------------------------------------------------------------------------------

    /// The `run` request of an execution, and its status.
    async fn run(&self, workflow: &str, execution_id: &str) -> Result<Run, AdminError> {
        let Some((record, summary)) =
            workflows::run(&*self.messages, workflow, execution_id).await?
        else {
            return Err(AdminError::NotFound(format!(
                "workflow {workflow} has no execution {execution_id}"
            )));
        };
        Ok(Run { address: record.address.clone(), status: summary.status, summary, record })
    }

    /// Stores a `deferred` request completing `name` of the execution at `address`, as the
    /// engine stores one (its primary key is the name: the first completion wins). Whether it
    /// was stored (`false`: one was stored already).
    async fn store_deferred(
        &self,
        address: &EntityAddress,
        name: &str,
        exit: &Exit,
    ) -> Result<bool, AdminError> {
        use cluster_core::encoded::JsonForm;
        let payload = format!(
            "{{\"name\":{},\"exit\":{}}}",
            serde_json::Value::String(name.to_owned()),
            exit.to_json()
        );
        let payload = RawJson::from_json(payload).map_err(|error| {
            AdminError::Refused(format!("the completion cannot be encoded: {error}"))
        })?;
        let options = SaveRequestOptions {
            primary_key: Some(primary_key(address, "deferred", name)),
            deliver_at: None,
        };
        let result = self
            .with_new_id(|id| {
                let request = Request {
                    request_id: id,
                    address: address.clone(),
                    tag: "deferred".into(),
                    payload: payload.clone(),
                    headers: RawJson::empty_object(),
                    trace: TraceContext::default(),
                };
                let (messages, options) = (Arc::clone(&self.messages), options.clone());
                async move { messages.save_request(&request, &options).await }
            })
            .await?;
        Ok(matches!(result, SaveResult::Success))
    }

    /// Runs a write with a new id, again with another when the id is taken.
    async fn with_new_id<T, F, Fut>(&self, write: F) -> Result<T, AdminError>
    where
        F: Fn(Snowflake) -> Fut,
        Fut: std::future::Future<Output = Result<T, StorageError>>,
    {
        let mut attempt = 1;
        loop {
            let id = self.ids.next(self.now());
            match write(id).await {
                Err(error)
                    if error.kind() == StorageErrorKind::Conflict && attempt < ID_ATTEMPTS =>
                {
                    attempt += 1;
                }
                result => return Ok(result?),
            }
        }
    }
}

/// An execution's `run` request and its status.
struct Run {
    address: EntityAddress,
    status: ExecutionStatus,
    summary: workflows::ExecutionSummary,
    record: RequestRecord,
}

/// Whether an exit is a defect: a failure with a `Die` reason.
pub(crate) fn is_defect(exit: &Exit) -> bool {
    matches!(exit, Exit::Failure(Cause(reasons)) if reasons.iter().any(|reason| matches!(reason, CauseReason::Die(_))))
}

/// Logs an action with who asked for it.
fn log(actor: &str, action: &str, target: &str, outcome: &Action) {
    tracing::info!(
        target: "durable_cluster::admin",
        actor,
        action,
        target,
        changed = outcome.changed(),
        outcome = outcome.message(),
        "admin action"
    );
}

#[cfg(test)]
mod tests {
    use cluster_core::envelope::{Reply, WithExit};
    use cluster_core::snowflake::SnowflakeParts;
    use cluster_core::{EntityId, Runner, RunnerWeight, ShardGroup};
    use cluster_testkit::memory::{
        MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage,
    };
    use cluster_workflow::WorkflowResult;

    use super::*;

    /// A snowflake made `ago` before `now`.
    fn made(now: Timestamp, ago: Duration, sequence: u16) -> Snowflake {
        let timestamp = now.saturating_sub(ago);
        Snowflake::from_parts(SnowflakeParts { timestamp, machine_id: MachineId::new(1), sequence })
    }

    fn request(
        id: Snowflake,
        entity_type: &str,
        entity_id: &str,
        tag: &str,
        payload: &str,
    ) -> Request {
        Request {
            request_id: id,
            address: EntityAddress {
                shard_id: ShardId::new(ShardGroup::default_group(), 1),
                entity_type: EntityType::from(entity_type),
                entity_id: EntityId::from(entity_id),
            },
            tag: tag.into(),
            payload: RawJson::from_json(payload.to_owned()).unwrap(),
            headers: RawJson::empty_object(),
            trace: TraceContext::default(),
        }
    }

    fn reply(request_id: Snowflake, id: Snowflake, exit: Exit) -> Reply {
        Reply::WithExit(WithExit { request_id, id, exit })
    }

    fn suspended() -> Exit {
        Exit::Success(RawJson::from_json(WorkflowResult::suspended().to_json()).unwrap())
    }

    /// Old due messages are stuck with their shard's holder; a suspended execution with a
    /// completion stored after it suspended, long ago, missed its wake; recent work is not stuck.
    #[tokio::test]
    async fn stuck_work_names_old_backlogs_and_missed_wakes() {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let now = clock.now();
        let messages = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
        let database = MemoryRunnerDatabase::new(Arc::clone(&clock));
        let runners = Arc::new(MemoryRunnerStorage::new(database, Duration::from_secs(60)));
        let address = RunnerAddress::new("10.0.0.1", 34431);
        let runner =
            Runner::new(address.clone(), vec![ShardGroup::default_group()], RunnerWeight::ONE);
        runners.register(&runner, true).await.unwrap();
        runners.acquire(&address, &[ShardId::new(ShardGroup::default_group(), 1)]).await.unwrap();
        let hour = Duration::from_secs(3_600);
        // A `run` request has its primary key, as the engine stores it.
        let save = |request: Request| {
            let messages = Arc::clone(&messages);
            let key =
                (request.tag.as_str() == "run").then(|| primary_key(&request.address, "run", ""));
            let options = SaveRequestOptions { primary_key: key, deliver_at: None };
            async move { messages.save_request(&request, &options).await.unwrap() }
        };
        // An old counter request waits; a fresh one of another type does not count.
        save(request(made(now, hour, 0), "Counter", "c1", "Increment", "{}")).await;
        save(request(made(now, Duration::ZERO, 0), "Fresh", "f1", "Get", "{}")).await;
        // An execution suspended two hours ago, whose deferred was completed an hour ago.
        let missed = made(now, hour * 2, 1);
        save(request(missed, "Workflow/Order", "o1", "run", "{}")).await;
        messages.save_reply(&reply(missed, made(now, hour * 2, 2), suspended())).await.unwrap();
        let deferred = made(now, hour, 3);
        save(request(
            deferred,
            "Workflow/Order",
            "o1",
            "deferred",
            r#"{"name":"paid","exit":{"_tag":"Success","value":1}}"#,
        ))
        .await;
        messages.save_reply(&reply(deferred, made(now, hour, 4), Exit::void())).await.unwrap();
        // An execution that suspended after its completion: not stuck.
        let waiting = made(now, hour * 2, 5);
        save(request(waiting, "Workflow/Order", "o2", "run", "{}")).await;
        messages
            .save_reply(&reply(waiting, made(now, Duration::from_secs(60), 6), suspended()))
            .await
            .unwrap();

        let admin = Admin::new(messages, runners, ShardingConfig::default());
        let stuck = admin.stuck(Duration::from_secs(600)).await.unwrap();
        let types: Vec<&str> =
            stuck.backlogs.iter().map(|late| late.backlog.entity_type.as_str()).collect();
        assert_eq!(types, ["Counter"], "{stuck:?}");
        assert_eq!(stuck.backlogs[0].holder, Some(LockHolder::Runner(address)));
        let executions: Vec<&str> =
            stuck.executions.iter().map(|summary| summary.execution_id.as_str()).collect();
        assert_eq!(executions, ["o1"], "{stuck:?}");
        assert!(!stuck.is_empty());
        // With a threshold past their age, nothing is stuck.
        assert!(admin.stuck(hour * 3).await.unwrap().is_empty());
    }
}
