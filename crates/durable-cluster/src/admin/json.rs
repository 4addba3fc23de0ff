//! The JSON forms of the admin's views, as the CLI's `--json` prints them and the `/admin`
//! endpoints answer them. Times are epoch milliseconds and ages milliseconds; ids are strings
//! (a snowflake does not fit a JavaScript number).

use std::time::Duration;

use cluster_core::Timestamp;
use cluster_core::encoded::JsonForm;
use cluster_core::envelope::{Exit, RawJson};
use cluster_core::inspect::{Backlog, LockHolder, RequestRecord, RunnerRecord, ShardLock};
use cluster_workflow::WorkflowResult;
use cluster_workflow::inspect::{
    ExecutionDetail, ExecutionPage, ExecutionSummary, Step, StepKind, StepOutcome,
};
use serde_json::{Value, json};

use super::{Action, ShardView, StuckWork};

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn time(timestamp: Timestamp) -> i64 {
    timestamp.unix_millis()
}

/// A stored JSON value as a JSON value (`null` when it is not JSON).
fn raw(value: &RawJson) -> Value {
    value.json().and_then(|json| serde_json::from_str(json).ok()).unwrap_or(Value::Null)
}

/// An exit in the reference's JSON form.
pub fn exit(exit: &Exit) -> Value {
    serde_json::from_str(&exit.to_json()).unwrap_or(Value::Null)
}

/// A lock holder: `{"runner": address}` or `{"session": id}`.
pub fn holder(holder: &LockHolder) -> Value {
    match holder {
        LockHolder::Runner(address) => json!({ "runner": address.to_string() }),
        LockHolder::Session(session) => json!({ "session": session }),
    }
}

/// A runner.
pub fn runner(record: &RunnerRecord) -> Value {
    json!({
        "address": record.runner.address.to_string(),
        "machineId": record.machine_id.get(),
        "groups": record.runner.groups.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "weight": record.runner.weight.get(),
        "healthy": record.healthy,
        "alive": record.alive,
        "heartbeatAgeMs": millis(record.heartbeat_age),
    })
}

/// A lock.
pub fn lock(lock: &ShardLock) -> Value {
    json!({
        "holder": holder(&lock.holder),
        "leaseAgeMs": lock.lease_age.map(millis),
        "expired": lock.expired,
    })
}

/// A shard of the shard map.
pub fn shard(view: &ShardView) -> Value {
    json!({
        "shard": view.shard_id.to_string(),
        "assigned": view.assigned.as_ref().map(ToString::to_string),
        "lock": view.lock.as_ref().map(lock),
        "agrees": view.agrees(),
    })
}

/// A backlog, with its oldest message's age at `now`.
pub fn backlog(backlog: &Backlog, now: Timestamp) -> Value {
    json!({
        "entityType": backlog.entity_type,
        "shard": backlog.shard_id.to_string(),
        "due": backlog.due,
        "scheduled": backlog.scheduled,
        "claimed": backlog.claimed,
        "staleClaims": backlog.stale_claims,
        "waitingSince": backlog.waiting_since.map(time),
        "oldestAgeMs": millis(backlog.oldest_age(now)),
    })
}

/// A request with its final reply.
pub fn request(record: &RequestRecord) -> Value {
    json!({
        "id": record.request_id.to_string(),
        "entityType": record.address.entity_type.as_str(),
        "entityId": record.address.entity_id.as_str(),
        "shard": record.shard_id.to_string(),
        "tag": record.tag,
        "sentAt": time(record.request_id.timestamp()),
        "payload": record.payload.as_ref().map(raw),
        "processed": record.processed,
        "claimed": record.claimed,
        "deliverAt": record.deliver_at.map(time),
        "interrupted": record.interrupted,
        "reply": record.reply.as_ref().map(|reply| json!({
            "id": reply.id.to_string(),
            "at": time(reply.id.timestamp()),
            "exit": exit(&reply.exit),
        })),
    })
}

/// A workflow result.
pub fn result(result: &WorkflowResult) -> Value {
    serde_json::from_str(&result.to_json()).unwrap_or(Value::Null)
}

/// An execution.
pub fn execution(summary: &ExecutionSummary) -> Value {
    json!({
        "workflow": summary.workflow,
        "executionId": summary.execution_id,
        "requestId": summary.request_id.to_string(),
        "shard": summary.shard_id.to_string(),
        "status": summary.status.as_str(),
        "suspendedOnFailure": summary.suspended_on_failure,
        "startedAt": time(summary.started),
        "updatedAt": summary.updated.map(time),
        "parent": summary.parent.as_ref().map(|parent| json!({
            "workflow": parent.workflow,
            "executionId": parent.execution_id,
        })),
        "result": summary.result.as_ref().map(result),
    })
}

/// A page of executions.
pub fn executions(page: &ExecutionPage) -> Value {
    json!({
        "executions": page.executions.iter().map(execution).collect::<Vec<_>>(),
        "next": page.next.map(|next| next.to_string()),
    })
}

/// A step of a timeline.
pub fn step(step: &Step) -> Value {
    let (outcome, exit_value) = match &step.outcome {
        StepOutcome::Pending => ("pending", Value::Null),
        StepOutcome::Suspended => ("suspended", Value::Null),
        StepOutcome::Done(done) => ("done", exit(done)),
    };
    json!({
        "requestId": step.request_id.to_string(),
        "kind": step.kind.as_str(),
        "name": step.name,
        "attempt": match step.kind { StepKind::Activity { attempt } => Some(attempt), _ => None },
        "wakeAt": match step.kind { StepKind::Sleep { wake_at } => Some(time(wake_at)), _ => None },
        "sentAt": time(step.sent),
        "answeredAt": step.answered.map(time),
        "outcome": outcome,
        "exit": exit_value,
    })
}

/// One execution with its timeline.
pub fn detail(detail: &ExecutionDetail) -> Value {
    json!({
        "execution": execution(&detail.summary),
        "payload": detail.payload.as_ref().map(raw),
        "steps": detail.steps.iter().map(step).collect::<Vec<_>>(),
    })
}

/// The stuck work.
pub fn stuck(stuck: &StuckWork) -> Value {
    json!({
        "at": time(stuck.at),
        "thresholdMs": millis(stuck.threshold),
        "backlogs": stuck.backlogs.iter().map(|late| {
            let mut value = backlog(&late.backlog, stuck.at);
            value["holder"] = late.holder.as_ref().map_or(Value::Null, holder);
            value
        }).collect::<Vec<_>>(),
        "executions": stuck.executions.iter().map(execution).collect::<Vec<_>>(),
    })
}

/// An action's outcome.
pub fn action(action: &Action) -> Value {
    json!({ "changed": action.changed(), "message": action.message() })
}
