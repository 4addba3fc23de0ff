//! The workflow read model: executions listed by workflow, status and start time, and one
//! execution's timeline, read from the cluster engine's tables.
//!
//! The cluster engine keeps every durable fact as a request of the execution's entity
//! (`Workflow/<name>`, id: the execution id) and its reply: `run` (its reply is the current
//! [`WorkflowResult`]), `activity`, `deferred` and `resume`; sleeps are requests of the clock
//! entity (`Workflow/-/DurableClock`, same id). So these reads need nothing but the storage's
//! [`requests`](MessageStorage::requests): they work from any process that reaches the
//! database, with no runner up, and they read executions that TypeScript runners wrote.
//!
//! An execution's status comes from its `run` request:
//!
//! - no reply yet: [`Running`](ExecutionStatus::Running) (waiting for a runner, or running);
//! - a `Suspended` reply: [`Suspended`](ExecutionStatus::Suspended) (waiting for a deferred, a
//!   clock, a child or a resume);
//! - a `Complete` reply: [`Completed`](ExecutionStatus::Completed) on success,
//!   [`Interrupted`](ExecutionStatus::Interrupted) when its cause holds only interruptions,
//!   [`Failed`](ExecutionStatus::Failed) otherwise.

use std::fmt;
use std::str::FromStr;

use cluster_core::encoded::JsonForm;
use cluster_core::envelope::primary_key;
use cluster_core::envelope::{Exit, RawJson, WithExit};
use cluster_core::error::StorageError;
use cluster_core::inspect::{LIMIT_MAX, RequestQuery, RequestRecord};
use cluster_core::retention::replied_before;
use cluster_core::storage::MessageStorage;
use cluster_core::{
    EntityAddress, EntityId, EntityType, ShardGroup, ShardId, Snowflake, Timestamp,
};
use serde::Deserialize;

use crate::cluster_engine::{CLOCK_ENTITY, INTERRUPT_SIGNAL, INTERRUPT_UNSAFE, PARENT_KEY};
use crate::result::WorkflowResult;

/// The entity types of workflow executions start with this.
const WORKFLOW_PREFIX: &str = "Workflow/";

/// The deferreds a durable clock completes start with this; the sleep's step stands for them.
const CLOCK_DEFERRED_PREFIX: &str = "DurableClock/";

/// The most requests [`executions`] reads to fill one page when it filters by status: past
/// this it returns a shorter page with a cursor to go on from.
pub const SCAN_MAX: u32 = 10_000;

/// The requests [`executions`] reads at once when it filters by status.
const STATUS_SCAN_PAGE: u32 = 250;

/// The most steps [`execution`] reads of one execution.
pub const STEPS_MAX: usize = 10_000;

/// Where an execution stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExecutionStatus {
    /// Its run has no reply yet: it waits for a runner or runs.
    Running,
    /// Its last run suspended.
    Suspended,
    /// It completed with success.
    Completed,
    /// It completed with a failure or a defect.
    Failed,
    /// It completed interrupted.
    Interrupted,
}

impl ExecutionStatus {
    /// Every status, in the order above.
    pub const ALL: [ExecutionStatus; 5] = [
        ExecutionStatus::Running,
        ExecutionStatus::Suspended,
        ExecutionStatus::Completed,
        ExecutionStatus::Failed,
        ExecutionStatus::Interrupted,
    ];

    /// The status in lowercase, as the CLI and the console name it.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionStatus::Running => "running",
            ExecutionStatus::Suspended => "suspended",
            ExecutionStatus::Completed => "completed",
            ExecutionStatus::Failed => "failed",
            ExecutionStatus::Interrupted => "interrupted",
        }
    }

    /// Whether the execution ended (it never runs again).
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            ExecutionStatus::Completed | ExecutionStatus::Failed | ExecutionStatus::Interrupted
        )
    }
}

impl fmt::Display for ExecutionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A status name that is none of [`ExecutionStatus::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown execution status {0:?}: use one of running, suspended, completed, failed, interrupted"
)]
pub struct UnknownStatus(pub String);

impl FromStr for ExecutionStatus {
    type Err = UnknownStatus;

    fn from_str(text: &str) -> Result<ExecutionStatus, UnknownStatus> {
        ExecutionStatus::ALL
            .into_iter()
            .find(|status| status.as_str().eq_ignore_ascii_case(text))
            .ok_or_else(|| UnknownStatus(text.to_owned()))
    }
}

/// The parent of a child execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParentRef {
    /// The parent's workflow name.
    pub workflow: String,
    /// The parent's execution id.
    pub execution_id: String,
}

/// An execution, as [`executions`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionSummary {
    /// The workflow's name.
    pub workflow: String,
    /// The execution id.
    pub execution_id: String,
    /// The id of its `run` request: the listing's cursor.
    pub request_id: Snowflake,
    /// Its shard: its requests are read through the shard's index.
    pub shard_id: ShardId,
    /// Where it stands.
    pub status: ExecutionStatus,
    /// A suspension that its own `suspend_on_failure` caused: only a resume or an interrupt
    /// moves it on.
    pub suspended_on_failure: bool,
    /// When it started (its `run` request was sent).
    pub started: Timestamp,
    /// When its last run ended (its reply was made), if one did: the end time of a finished
    /// execution.
    pub updated: Option<Timestamp>,
    /// Its parent, for a child.
    pub parent: Option<ParentRef>,
    /// Its stored result, if its run has a reply that reads as one.
    pub result: Option<WorkflowResult>,
}

/// Which executions [`executions`] lists, newest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionQuery {
    /// Only this workflow.
    pub workflow: Option<String>,
    /// Only this execution id.
    pub execution_id: Option<String>,
    /// Only executions with this status.
    pub status: Option<ExecutionStatus>,
    /// Only executions started at or after this time.
    pub started_from: Option<Timestamp>,
    /// Only executions started before this time.
    pub started_until: Option<Timestamp>,
    /// Only executions older than this cursor (a page's [`ExecutionPage::next`]).
    pub cursor: Option<Snowflake>,
    /// The most executions listed, 1 to [`LIMIT_MAX`].
    pub limit: u32,
}

impl ExecutionQuery {
    /// The newest `limit` executions of every workflow.
    pub fn newest(limit: u32) -> ExecutionQuery {
        ExecutionQuery {
            workflow: None,
            execution_id: None,
            status: None,
            started_from: None,
            started_until: None,
            cursor: None,
            limit,
        }
    }
}

/// One page of [`executions`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionPage {
    /// The executions, newest first.
    pub executions: Vec<ExecutionSummary>,
    /// The cursor of the next page, if there may be more.
    pub next: Option<Snowflake>,
}

/// Lists executions, newest first, as `query` selects them.
///
/// A status filter is applied to the `run` requests as they are read. If [`SCAN_MAX`] requests
/// did not fill the page, the page is shorter and its cursor goes on from there.
///
/// # Errors
///
/// The storage's error; a limit outside 1 to [`LIMIT_MAX`] is an `InvalidInput`.
pub async fn executions(
    storage: &dyn MessageStorage,
    query: &ExecutionQuery,
) -> Result<ExecutionPage, StorageError> {
    cluster_core::inspect::check_limit("executions", query.limit)?;
    let mut requests = RequestQuery {
        entity_type_prefix: WORKFLOW_PREFIX.to_owned(),
        entity_type: query.workflow.as_ref().map(|workflow| format!("{WORKFLOW_PREFIX}{workflow}")),
        entity_id: query.execution_id.clone(),
        tag: Some("run".to_owned()),
        after: query
            .started_from
            .map(|from| Snowflake::new(replied_before(from).get().saturating_sub(1))),
        before: started_before(query),
        newest_first: true,
        // Filtered by status, the requests are read in pages of their own size, so that a rare
        // status takes a few statements, not one per page of the caller's size; not the
        // largest pages, as each row carries its payload and result.
        limit: if query.status.is_some() { STATUS_SCAN_PAGE.max(query.limit) } else { query.limit },
        ..RequestQuery::default()
    };
    let mut listed = Vec::new();
    let mut scanned = 0_u32;
    loop {
        let page = storage.requests(&requests).await?;
        let full = u32::try_from(page.len()).unwrap_or(u32::MAX) == requests.limit;
        let last = page.last().map(|record| record.request_id);
        scanned = scanned.saturating_add(u32::try_from(page.len()).unwrap_or(u32::MAX));
        for record in page {
            // The clock entity's `run` requests are sleeps, not executions.
            if record.address.entity_type.as_str() == CLOCK_ENTITY {
                continue;
            }
            let summary = summary(&record);
            if query.status.is_none_or(|status| status == summary.status) {
                listed.push(summary);
            }
            if listed.len() == usize::try_from(query.limit).unwrap_or(usize::MAX) {
                let next = listed.last().map(|summary| summary.request_id);
                return Ok(ExecutionPage { executions: listed, next });
            }
        }
        let Some(last) = last.filter(|_| full) else {
            return Ok(ExecutionPage { executions: listed, next: None });
        };
        if scanned >= SCAN_MAX {
            return Ok(ExecutionPage { executions: listed, next: Some(last) });
        }
        requests.before = Some(last);
    }
}

/// The upper id bound of `query`: its cursor or its end time, whichever is lower.
fn started_before(query: &ExecutionQuery) -> Option<Snowflake> {
    let until = query.started_until.map(replied_before);
    match (query.cursor, until) {
        (Some(cursor), Some(until)) => Some(cursor.min(until)),
        (cursor, until) => cursor.or(until),
    }
}

/// The summary of a `run` request.
fn summary(record: &RequestRecord) -> ExecutionSummary {
    let workflow = record
        .address
        .entity_type
        .as_str()
        .strip_prefix(WORKFLOW_PREFIX)
        .unwrap_or(record.address.entity_type.as_str())
        .to_owned();
    let result = record.reply.as_ref().and_then(run_result);
    let (status, suspended_on_failure) = match (&record.reply, &result) {
        (None, _) => (ExecutionStatus::Running, false),
        (Some(_), Some(WorkflowResult::Suspended { failed, .. })) => {
            (ExecutionStatus::Suspended, *failed)
        }
        (Some(_), Some(WorkflowResult::Complete(exit))) => (exit_status(exit), false),
        // A reply that is not a result: the run ended with a defect.
        (Some(_), None) => (ExecutionStatus::Failed, false),
    };
    ExecutionSummary {
        workflow,
        execution_id: record.address.entity_id.as_str().to_owned(),
        request_id: record.request_id,
        shard_id: record.shard_id.clone(),
        status,
        suspended_on_failure,
        started: record.request_id.timestamp(),
        updated: record.reply.as_ref().map(|reply| reply.id.timestamp()),
        parent: record.payload.as_ref().and_then(parent),
        result,
    }
}

/// The status of a completed execution's exit.
fn exit_status(exit: &Exit) -> ExecutionStatus {
    match exit {
        Exit::Success(_) => ExecutionStatus::Completed,
        Exit::Failure(cause) if cause.has_interrupts_only() => ExecutionStatus::Interrupted,
        Exit::Failure(_) => ExecutionStatus::Failed,
    }
}

/// The [`WorkflowResult`] a `run` or `activity` reply holds, if it holds one.
fn run_result(reply: &WithExit) -> Option<WorkflowResult> {
    match &reply.exit {
        Exit::Success(value) => value.json().and_then(|json| WorkflowResult::from_json(json).ok()),
        Exit::Failure(_) => None,
    }
}

/// The parent named in a `run` payload.
fn parent(payload: &RawJson) -> Option<ParentRef> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Wire {
        workflow_name: String,
        execution_id: String,
    }
    let fields: serde_json::Map<String, serde_json::Value> = payload.decode().ok()?;
    let wire: Wire = serde_json::from_value(fields.get(PARENT_KEY)?.clone()).ok()?;
    Some(ParentRef { workflow: wire.workflow_name, execution_id: wire.execution_id })
}

/// What a step of an execution is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// One attempt of an activity.
    Activity {
        /// The attempt, from 1.
        attempt: u32,
    },
    /// A completion of a deferred.
    Deferred,
    /// A durable interrupt (the interrupt signal's deferred).
    Interrupt,
    /// A wake: from a child (the step's name is its execution id) or an explicit resume.
    Resume,
    /// A durable sleep, woken at this time.
    Sleep {
        /// When the clock wakes the execution.
        wake_at: Timestamp,
    },
}

impl StepKind {
    /// The kind in lowercase.
    pub fn as_str(&self) -> &'static str {
        match self {
            StepKind::Activity { .. } => "activity",
            StepKind::Deferred => "deferred",
            StepKind::Interrupt => "interrupt",
            StepKind::Resume => "resume",
            StepKind::Sleep { .. } => "sleep",
        }
    }
}

/// How a step ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// Not answered yet: the activity runs or waits, the clock has not fired.
    Pending,
    /// The activity's attempt suspended (its caller went away); it runs again when called.
    Suspended,
    /// Done, with this exit.
    Done(Exit),
}

/// One step of an execution: a request of its entity, or of its clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The request's id.
    pub request_id: Snowflake,
    /// What it is.
    pub kind: StepKind,
    /// The activity's, deferred's or clock's name; the waking child's execution id.
    pub name: String,
    /// When it was sent.
    pub sent: Timestamp,
    /// When it was answered.
    pub answered: Option<Timestamp>,
    /// How it ended.
    pub outcome: StepOutcome,
}

/// One execution with its steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionDetail {
    /// The execution.
    pub summary: ExecutionSummary,
    /// Its payload (with the parent field, for a child), if it is JSON.
    pub payload: Option<RawJson>,
    /// Its steps, in the order they were sent (at most [`STEPS_MAX`]).
    pub steps: Vec<Step>,
}

/// One execution of `workflow` with its steps, or `None` if it has no `run` request.
///
/// # Errors
///
/// The storage's error.
pub async fn execution(
    storage: &dyn MessageStorage,
    workflow: &str,
    execution_id: &str,
) -> Result<Option<ExecutionDetail>, StorageError> {
    let Some(run) = run_request(storage, workflow, execution_id).await? else { return Ok(None) };
    let entity_type = format!("{WORKFLOW_PREFIX}{workflow}");
    let mut steps = Vec::new();
    // The clock's requests are on the execution's shard too (its client is in the workflow's
    // shard group): both reads go through the shard index.
    for entity_type in [entity_type.as_str(), CLOCK_ENTITY] {
        let mut query = RequestQuery {
            shard_id: Some(run.shard_id.clone()),
            entity_type: Some(entity_type.to_owned()),
            entity_id: Some(execution_id.to_owned()),
            limit: LIMIT_MAX,
            ..RequestQuery::default()
        };
        loop {
            let page = storage.requests(&query).await?;
            let full = page.len() == usize::try_from(LIMIT_MAX).unwrap_or(usize::MAX);
            query.after = page.last().map(|record| record.request_id);
            for record in page {
                if entity_type == CLOCK_ENTITY {
                    steps.extend(sleep(&record, workflow));
                } else if record.tag != "run" {
                    steps.extend(step(&record));
                }
            }
            if !full || steps.len() >= STEPS_MAX {
                break;
            }
        }
    }
    steps.sort_by_key(|step| step.request_id);
    steps.truncate(STEPS_MAX);
    Ok(Some(ExecutionDetail { summary: summary(&run), payload: run.payload.clone(), steps }))
}

/// The `run` request of an execution of `workflow`, if it has one, with its status
/// ([`ExecutionSummary`]). Found by its primary key (the `message_id` index), not by a scan.
///
/// # Errors
///
/// The storage's error.
pub async fn run(
    storage: &dyn MessageStorage,
    workflow: &str,
    execution_id: &str,
) -> Result<Option<(RequestRecord, ExecutionSummary)>, StorageError> {
    let run = run_request(storage, workflow, execution_id).await?;
    Ok(run.map(|run| {
        let summary = summary(&run);
        (run, summary)
    }))
}

/// The `run` request of an execution, by its primary key (`Workflow/<name>/<id>/run/`).
async fn run_request(
    storage: &dyn MessageStorage,
    workflow: &str,
    execution_id: &str,
) -> Result<Option<RequestRecord>, StorageError> {
    // The key names the entity's type and id; the shard is not part of it.
    let address = EntityAddress {
        shard_id: ShardId::new(ShardGroup::default_group(), 1),
        entity_type: EntityType::from(format!("{WORKFLOW_PREFIX}{workflow}")),
        entity_id: EntityId::from(execution_id),
    };
    let key = primary_key(&address, "run", "");
    let Some(request_id) = storage.request_id_for_primary_key(&key).await? else {
        return Ok(None);
    };
    let query = RequestQuery { request_id: Some(request_id), ..RequestQuery::all(1) };
    Ok(storage.requests(&query).await?.pop())
}

/// The step of an `activity`, `deferred` or `resume` request (`None` for another tag or a
/// payload that cannot be read).
fn step(record: &RequestRecord) -> Option<Step> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Named {
        #[serde(default)]
        name: String,
        #[serde(default)]
        attempt: u32,
        #[serde(default)]
        child_execution_id: Option<String>,
    }
    let payload = record.payload.as_ref()?;
    let named: Named = payload.decode().ok()?;
    let answered = record.reply.as_ref().map(|reply| reply.id.timestamp());
    let (kind, name, outcome) = match record.tag.as_str() {
        "activity" => {
            let outcome = match record.reply.as_ref() {
                None => StepOutcome::Pending,
                Some(reply) => match run_result(reply) {
                    Some(WorkflowResult::Complete(exit)) => StepOutcome::Done(exit),
                    Some(WorkflowResult::Suspended { .. }) => StepOutcome::Suspended,
                    None => StepOutcome::Done(reply.exit.clone()),
                },
            };
            (StepKind::Activity { attempt: named.attempt }, named.name, outcome)
        }
        // A clock's wake: its sleep step shows it.
        "deferred" if named.name.starts_with(CLOCK_DEFERRED_PREFIX) => return None,
        "deferred" => {
            let kind = if named.name == INTERRUPT_SIGNAL || named.name == INTERRUPT_UNSAFE {
                StepKind::Interrupt
            } else {
                StepKind::Deferred
            };
            // The completion's exit is the request's own payload; its reply repeats the first
            // completion stored.
            let exit = deferred_exit(payload);
            (kind, named.name, exit.map_or(StepOutcome::Pending, StepOutcome::Done))
        }
        "resume" => {
            let outcome = record
                .reply
                .as_ref()
                .map_or(StepOutcome::Pending, |reply| StepOutcome::Done(reply.exit.clone()));
            (StepKind::Resume, named.child_execution_id.unwrap_or_default(), outcome)
        }
        _ => return None,
    };
    Some(Step {
        request_id: record.request_id,
        kind,
        name,
        sent: record.request_id.timestamp(),
        answered,
        outcome,
    })
}

/// The exit a `deferred` request's payload carries.
fn deferred_exit(payload: &RawJson) -> Option<Exit> {
    #[derive(Deserialize)]
    struct Wire<'a> {
        #[serde(borrow)]
        exit: &'a serde_json::value::RawValue,
    }
    let wire: Wire<'_> = serde_json::from_str(payload.json()?).ok()?;
    Exit::from_json(wire.exit.get()).ok()
}

/// The step of a clock request, if it is `workflow`'s.
fn sleep(record: &RequestRecord, workflow: &str) -> Option<Step> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Clock {
        name: String,
        workflow_name: String,
        wake_up: i64,
    }
    let clock: Clock = record.payload.as_ref()?.decode().ok()?;
    if clock.workflow_name != workflow {
        return None;
    }
    Some(Step {
        request_id: record.request_id,
        kind: StepKind::Sleep { wake_at: Timestamp::from_unix_millis(clock.wake_up) },
        name: clock.name,
        sent: record.request_id.timestamp(),
        answered: record.reply.as_ref().map(|reply| reply.id.timestamp()),
        outcome: record
            .reply
            .as_ref()
            .map_or(StepOutcome::Pending, |reply| StepOutcome::Done(reply.exit.clone())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_parse_in_any_case_and_name_the_choices() {
        for status in ExecutionStatus::ALL {
            assert_eq!(status.as_str().parse::<ExecutionStatus>(), Ok(status));
            assert_eq!(status.as_str().to_uppercase().parse::<ExecutionStatus>(), Ok(status));
        }
        let error = "done".parse::<ExecutionStatus>().unwrap_err();
        assert!(error.to_string().contains("running, suspended"), "{error}");
        assert!(ExecutionStatus::Interrupted.is_finished());
        assert!(!ExecutionStatus::Suspended.is_finished());
    }

    #[test]
    fn the_cursor_and_the_end_time_bound_the_ids_together() {
        let mut query = ExecutionQuery::newest(10);
        assert_eq!(started_before(&query), None);
        query.cursor = Some(Snowflake::new(5));
        assert_eq!(started_before(&query), Some(Snowflake::new(5)));
        query.started_until = Some(Timestamp::from_unix_millis(1_900_000_000_000));
        assert_eq!(started_before(&query), Some(Snowflake::new(5)));
        query.cursor = None;
        assert!(started_before(&query).is_some_and(|id| id > Snowflake::new(5)));
    }
}
